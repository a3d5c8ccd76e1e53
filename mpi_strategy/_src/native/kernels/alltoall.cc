// MpiStrategyAlltoall: row r to rank r, in one MPI call after the agreement
// (core/collectives.py alltoall; its data never rides in the agreement).

#include <vector>

#include "common.h"

namespace mpi_strategy_kernels {
namespace {

// Alltoall: inputs (token, x with one row per rank), outputs (token + 1, row
// r from rank r), in one MPI_Alltoall of bytes.
void AlltoallCompute(void* kernel, TF_OpKernelContext* ctx) {
  AfterAgreeing(kernel, ctx, [ctx](Site& site, TF_Tensor* input, TF_Status* status) {
    std::vector<int64_t> dims = Dims(input);
    const int64_t nbytes = TF_TensorByteSize(input);
    TF_Tensor* out = TF_AllocateOutput(ctx, 1, TF_TensorType(input), dims.data(),
                                       static_cast<int>(dims.size()), nbytes, status);
    const int piece = static_cast<int>(nbytes / site.state->size);
    const bool done =
        !Fail(ctx, status) &&
        MpiOk(ctx, site,
              mpi.Alltoall(TF_TensorData(input), piece, mpi.byte, TF_TensorData(out), piece,
                           mpi.byte, static_cast<Handle>(site.state->data_comm)));
    if (out != nullptr) TF_DeleteTensor(out);
    return done;
  });
}

struct Registration {
  Registration() {
    RegisterOp("MpiStrategyAlltoall", "input: T", "output: T", false, &Run<&AlltoallCompute>);
  }
} registration;

}  // namespace
}  // namespace mpi_strategy_kernels
