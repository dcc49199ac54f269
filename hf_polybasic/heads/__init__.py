"""Trained draft heads (EAGLE-1/2/3, native MTP layers): the modules and the formats they are published in.
How a head runs as a level of a chain: `hf_polybasic.runners.head`; the public entry: `hf_polybasic.levels.draft_head`."""
