// Hopper (wgmma) attention forward for head_dim 128.
#include "attention_fwd_sm90.cuh"

FUSEDOPS_ATTENTION_SM90_HEAD_DIM(128)
