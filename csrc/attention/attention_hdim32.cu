// Attention kernels for head_dim 32.
#include "attention_instantiate.cuh"

FUSEDOPS_ATTENTION_HEAD_DIM(32)
