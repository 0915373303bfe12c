// The two-product kernels of the linear layers (linear.cuh).
#include "linear.cuh"

namespace lbw {

LaunchResult launch_linear_two_products(const LinearParams& p, GemmTile tile, Epilogue e,
                                        cudaStream_t s, const LinearNormParams* norm) {
  return launch_tile<2>(p, tile, e, s, norm);
}

}  // namespace lbw
