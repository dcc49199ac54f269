import torch

# The tiny test models gain nothing from intra-op threads; one thread avoids OpenMP spin-waits on
# small, shared CI machines and makes the suite several times faster there.
torch.set_num_threads(1)
