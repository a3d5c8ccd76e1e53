// MpiStrategyBarrier: the agreement alone (core/collectives.py barrier).

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

struct Registration {
  Registration() {
    RegisterOp("MpiStrategyBarrier", nullptr, "output: int32", false, &Run<&BarrierCompute>,
               nullptr);
  }
} registration;

}  // namespace
}  // namespace mpi_strategy_kernels
