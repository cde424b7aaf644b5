"""Building blocks of the models; each is a plain nn.Module at tensor-parallel size 1."""
