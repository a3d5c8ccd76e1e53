// MpiStrategyReducescatter: a reduction cut into row shares, in one MPI call
// after the agreement (core/collectives.py reducescatter; its data never rides
// in the agreement).

#include <vector>

#include "common.h"

namespace mpi_strategy_kernels {
namespace {

// Reducescatter: inputs (token, x), outputs (token + 1, this rank's rows of
// the reduction: the first rows % size ranks one row more than the others).
void ReducescatterCompute(void* kernel, TF_OpKernelContext* ctx) {
  AfterAgreeing(kernel, ctx, [ctx](Site& site, TF_Tensor* input, TF_Status* status) {
    const State& state = *site.state;
    std::vector<int64_t> dims = Dims(input);
    const int64_t rows = dims.empty() ? 1 : dims[0];
    int64_t row = 1;
    for (size_t d = 1; d < dims.size(); ++d) row *= dims[d];
    auto share = [&](int64_t r) { return rows / state.size + (r < rows % state.size ? 1 : 0); };
    std::vector<int> counts(state.size);
    for (int64_t r = 0; r < state.size; ++r) counts[r] = static_cast<int>(share(r) * row);
    if (!dims.empty()) dims[0] = share(state.rank);
    const int64_t element = TF_DataTypeSize(TF_TensorType(input));
    TF_Tensor* out = TF_AllocateOutput(ctx, 1, TF_TensorType(input), dims.data(),
                                       static_cast<int>(dims.size()),
                                       counts[state.rank] * element, status);
    const bool done =
        !Fail(ctx, status) &&
        (TF_TensorByteSize(input) == 0 ||
         MpiOk(ctx, site,
               mpi.Reduce_scatter(TF_TensorData(input), TF_TensorData(out), counts.data(),
                                  site.mpi_dtype, site.mpi_op,
                                  static_cast<Handle>(state.data_comm))));
    if (out != nullptr) TF_DeleteTensor(out);
    return done;
  });
}

struct Registration {
  Registration() {
    RegisterOp("MpiStrategyReducescatter", "input: T", "output: T", false,
               &Run<&ReducescatterCompute>);
  }
} registration;

}  // namespace
}  // namespace mpi_strategy_kernels
