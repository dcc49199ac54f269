"""Models made for the levels of a chain: quantized copies and early exits (`copies`), int4 and nf4
layers, packed CPU layers, restricted vocabulary heads. Users reach them through `hf_polybasic.levels`."""
