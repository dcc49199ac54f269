import torch

# The tiny test models gain nothing from intra-op threads; one thread avoids OpenMP spin-waits on
# small, shared CI machines and makes the suite several times faster there.
torch.set_num_threads(1)

# Property tests draw their examples from a fixed seed: the suite gives the same verdict on every
# run (several of them are statistical tests at a fixed significance level).
from hypothesis import settings  # noqa: E402

settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.load_profile("deterministic")
