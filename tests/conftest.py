"""Suite-wide settings: one torch thread (the CI machine has 2 cores and runs tests serially)."""
import torch

torch.set_num_threads(1)
