// Where a dropout kernel finds its Philox seed and offset. Mirrors PyTorch's PhiloxCudaState
// without including torch: under CUDA-graph capture the values live in device memory and are
// read by the kernel at replay time, so each replay draws fresh numbers.
#pragma once
#include <cstdint>

namespace fusedops {

struct PhiloxArgs {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_ptr = nullptr;    // set when captured
  const int64_t* offset_ptr = nullptr;  // set when captured
  uint64_t offset_intragraph = 0;
  bool captured = false;
};

}  // namespace fusedops
