// MpiStrategyBarrier, MpiStrategyAlltoall and MpiStrategyReducescatter: the
// collectives whose data, if any, moves in one MPI call after the agreement
// and never rides in it (core/collectives.py barrier, alltoall, reducescatter).

#include <vector>

#include "common.h"

namespace mpi_strategy_kernels {
namespace {

// Barrier: inputs (token), outputs (token + 1, a scalar 0): the agreement alone.
void BarrierCompute(void* kernel, TF_OpKernelContext* ctx) {
  Site& site = *static_cast<Site*>(kernel);
  TF_Status* status = TF_NewStatus();
  const int64_t token = ReadToken(ctx, status);
  bool carried = false;
  if (TF_GetCode(status) == TF_OK && Agree(ctx, site, token, nullptr, 0, &carried)) {
    TF_Tensor* zero = TF_AllocateOutput(ctx, 1, TF_INT32, nullptr, 0, 4, status);
    if (!Fail(ctx, status)) {
      *static_cast<int32_t*>(TF_TensorData(zero)) = 0;
      SetToken(ctx, site, status);
    }
    if (zero != nullptr) TF_DeleteTensor(zero);
  }
  TF_DeleteStatus(status);
}

// Runs `body(site, input, status)` (true: done) between the agreement and
// the token's step, for a kernel of inputs (token, x) whose data never rides
// in the agreement.
template <typename Body>
void AfterAgreeing(void* kernel, TF_OpKernelContext* ctx, Body body) {
  Site& site = *static_cast<Site*>(kernel);
  TF_Status* status = TF_NewStatus();
  const int64_t token = ReadToken(ctx, status);
  std::vector<TF_Tensor*> inputs = Inputs(ctx, 1, status);
  bool carried = false;
  if (TF_GetCode(status) == TF_OK && Agree(ctx, site, token, nullptr, 0, &carried) &&
      body(site, inputs[0], status)) {
    SetToken(ctx, site, status);
  }
  for (TF_Tensor* input : inputs) TF_DeleteTensor(input);
  TF_DeleteStatus(status);
}

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
    RegisterOp("MpiStrategyBarrier", nullptr, "output: int32", false, &Run<&BarrierCompute>,
               nullptr);
    RegisterOp("MpiStrategyAlltoall", "input: T", "output: T", false, &Run<&AlltoallCompute>);
    RegisterOp("MpiStrategyReducescatter", "input: T", "output: T", false,
               &Run<&ReducescatterCompute>);
  }
} registration;

}  // namespace
}  // namespace mpi_strategy_kernels
