// Defines the mma.sync launchers for one head dim; each attention_hdim<D>.cu expands it once, so
// the head dims compile in parallel.
#pragma once
#include "attention_bwd.cuh"

#define FUSEDOPS_ATTENTION_HEAD_DIM(D)                                                       \
  FUSEDOPS_ATTENTION_LAUNCHER(launch_attention_fwd_hdim, AttentionFwdParams, attention::launch_fwd, D) \
  FUSEDOPS_ATTENTION_LAUNCHER(launch_attention_bwd_hdim, AttentionBwdParams, attention::launch_bwd, D)
