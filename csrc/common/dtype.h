// Element types the kernels are built for, named without torch so launchers stay plain C++.
#pragma once

namespace fusedops {

enum class DType { Float32, Float16, BFloat16, Float64 };

}  // namespace fusedops
