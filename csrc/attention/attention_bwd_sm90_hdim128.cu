// Hopper (wgmma) attention backward for head_dim 128.
#include "attention_bwd_sm90.cuh"

FUSEDOPS_ATTENTION_BWD_SM90_HEAD_DIM(128)
