"""Analysis: what the policy map asks of each op, before anything is rewritten.

Takes the loaded graphs and the policy map; gives frozen records the passes
consume and ``--explain`` prints.

    policy_map     the map: Keras's DTypePolicyMap lookup, read from JSON with diagnostics
    layer_index    which layer path each op and variable belongs to
    plan           layer path -> resolved policy (compute, variable dtype, quantization)
    quant_sites    which ops int8/int4/float8 quantize, and why others are declined
    index_limits   integer inputs' valid ranges (embedding tables), for generated inputs
"""
