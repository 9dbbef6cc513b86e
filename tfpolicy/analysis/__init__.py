"""Analysis: what the policy map asks of each op, before anything is rewritten.

Takes the loaded graphs and the policy map; gives frozen records the passes
consume and ``--explain`` prints.

    policy_map     the map: Keras's DTypePolicyMap lookup, read from JSON with diagnostics
    policy_json    the map's two JSON forms: parsing, line numbers, bounds on what can be built
    regex_limit    the time limit on matching a regex key (catastrophic backtracking)
    layer_index    which layer path each op and variable belongs to
    plan           layer path -> resolved policy (compute, variable dtype, quantization)
    quant_rules    which op types quantize, and how (the contraction of each)
    kernel_trace   from an op's operand back to the variable it reads, and the layout in between
    quant_sites    which ops int8/int4/float8 quantize, and why others are declined
    quant_records  the frozen records of that analysis (sites, kernels, float8 groups)
    calls          who calls each While/If body or function, and whether a new input can reach it
    lowering       --target: the form each quantized site takes, and what a target refuses
    index_limits   integer inputs' valid ranges (embedding tables), for generated inputs
"""
