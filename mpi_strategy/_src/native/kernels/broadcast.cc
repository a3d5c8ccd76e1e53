// MpiStrategyBroadcast: one tensor as it is on the root rank.

#include <cstring>

#include "common.h"

namespace mpi_strategy_kernels {
namespace {

// Broadcast: inputs (token, x), outputs (token + 1, x as on rank `root`).
void BroadcastCompute(void* kernel, TF_OpKernelContext* ctx) {
  Site& site = *static_cast<Site*>(kernel);
  TF_Status* status = TF_NewStatus();
  const int64_t token = ReadToken(ctx, status);
  TF_Tensor* out = TF_GetCode(status) == TF_OK ? OutputLike(ctx, 1, status) : nullptr;
  if (TF_GetCode(status) == TF_OK) {
    void* buffer = TF_TensorData(out);
    const int64_t nbytes = TF_TensorByteSize(out);
    bool carried = false;
    bool ok = Agree(ctx, site, token, buffer, nbytes, &carried);
    if (ok && carried) {
      if (nbytes > 0) std::memcpy(buffer, CarriedData(site, site.root), nbytes);
    } else if (ok) {
      ok = MpiOk(ctx, site,
                 mpi.Bcast(buffer, static_cast<int>(nbytes), mpi.byte,
                           static_cast<int>(site.root),
                           static_cast<Handle>(site.state->data_comm)));
    }
    if (ok) SetToken(ctx, site, status);
  }
  if (out != nullptr) TF_DeleteTensor(out);
  TF_DeleteStatus(status);
}

struct Registration {
  Registration() {
    RegisterOp("MpiStrategyBroadcast", "input: T", "output: T", false, &Run<&BroadcastCompute>);
  }
} registration;

}  // namespace
}  // namespace mpi_strategy_kernels
