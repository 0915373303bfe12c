// The three-product kernels of the linear layers (linear.cuh).
#include "linear.cuh"

namespace lbw {

LaunchResult launch_linear_three_products(const LinearParams& p, GemmTile tile, Epilogue e,
                                          cudaStream_t s, const LinearNormParams* norm) {
  return launch_tile<3>(p, tile, e, s, norm);
}

}  // namespace lbw
