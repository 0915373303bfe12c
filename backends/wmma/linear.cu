// launch_linear: the GEMMs of the linear layers by product count (see linear.cuh), with the
// one-product kernels; the two- and three-product ones are linear_two_products.cu's and
// linear_three_products.cu's.
#include "linear.cuh"

namespace lbw {

LaunchResult launch_linear(const LinearParams& p, GemmTile tile, int products,
                           Epilogue epilogue, cudaStream_t stream,
                           const LinearNormParams* norm) {
  if (static_cast<int>(epilogue) < 0 || static_cast<int>(epilogue) > 3)
    return {cudaErrorInvalidValue, "linear (unknown epilogue)"};
  if (p.M <= 0 || p.N <= 0) return {cudaSuccess, "linear (empty output)"};
  switch (products) {
    case 1: return launch_tile<1>(p, tile, epilogue, stream, norm);
    case 2: return launch_linear_two_products(p, tile, epilogue, stream, norm);
    case 3: return launch_linear_three_products(p, tile, epilogue, stream, norm);
  }
  return {cudaErrorInvalidValue, "linear (products must be 1, 2 or 3)"};
}

}  // namespace lbw
