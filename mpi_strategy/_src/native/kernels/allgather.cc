// MpiStrategyAllgather: tensors of any dtypes concatenated over the ranks
// along axis 0, their row counts free to differ between ranks.

#include <cstring>
#include <vector>

#include "common.h"

namespace mpi_strategy_kernels {
namespace {

int64_t Padded(int64_t nbytes) { return (nbytes + kPieceAlign - 1) / kPieceAlign * kPieceAlign; }

// What one rank sends in an all-gather (core/wire.py concat_bytes): its row
// count of each tensor, then each tensor's bytes, each piece padded to kPieceAlign.
struct Rows {
  std::vector<int64_t> rows, row_bytes;
  int64_t total_rows = 0;
};

Rows Pack(const std::vector<TF_Tensor*>& inputs, std::vector<uint8_t>* mine) {
  const int n = static_cast<int>(inputs.size());
  Rows pack{std::vector<int64_t>(n), std::vector<int64_t>(n)};
  int64_t nbytes = 8 * n;
  for (int i = 0; i < n; ++i) {
    pack.rows[i] = TF_NumDims(inputs[i]) ? TF_Dim(inputs[i], 0) : 1;
    int64_t row = TF_DataTypeSize(TF_TensorType(inputs[i]));
    for (int d = 1; d < TF_NumDims(inputs[i]); ++d) row *= TF_Dim(inputs[i], d);
    pack.row_bytes[i] = row;
    nbytes += Padded(pack.rows[i] * row);
    pack.total_rows += pack.rows[i];
  }
  mine->assign(nbytes, 0);
  std::memcpy(mine->data(), pack.rows.data(), 8 * n);
  int64_t at = 8 * n;
  for (int i = 0; i < n; ++i) {
    const int64_t size = pack.rows[i] * pack.row_bytes[i];
    if (size > 0) std::memcpy(mine->data() + at, TF_TensorData(inputs[i]), size);
    at += Padded(size);
  }
  return pack;
}

// Every rank's bytes, back to back in rank order (`starts`: where each begins).
bool Gather(TF_OpKernelContext* ctx, Site& site, const std::vector<uint8_t>& mine, bool carried,
            std::vector<uint8_t>* everyone, std::vector<int>* starts) {
  const int64_t size = site.state->size;
  int64_t nbytes = static_cast<int64_t>(mine.size());
  std::vector<int64_t> sizes(size);
  for (int64_t r = 0; r < size; ++r) sizes[r] = Signature(site, r)[kBytes];
  if (site.state->hashed &&  // (the hash agreed: no record says the sizes)
      !MpiOk(ctx, site,
             mpi.Allgather(&nbytes, 1, mpi.int64, sizes.data(), 1, mpi.int64,
                           static_cast<Handle>(site.state->agree_comm)))) {
    return false;
  }
  std::vector<int> counts(size);
  starts->resize(size);
  int64_t total = 0;
  for (int64_t r = 0; r < size; ++r) {
    counts[r] = static_cast<int>(sizes[r]);
    (*starts)[r] = static_cast<int>(total);
    total += counts[r];
  }
  everyone->resize(total);
  if (carried) {
    for (int64_t r = 0; r < size; ++r) {
      std::memcpy(everyone->data() + (*starts)[r], CarriedData(site, r), counts[r]);
    }
    return true;
  }
  return MpiOk(ctx, site,
               mpi.Allgatherv(mine.data(), static_cast<int>(nbytes), mpi.byte, everyone->data(),
                              counts.data(), starts->data(), mpi.byte,
                              static_cast<Handle>(site.state->data_comm)));
}

// Output i + 1: every rank's rows of input i, in rank order.
bool Unpack(TF_OpKernelContext* ctx, const std::vector<TF_Tensor*>& inputs, const Rows& pack,
            const std::vector<uint8_t>& everyone, const std::vector<int>& starts,
            TF_Status* status) {
  const int n = static_cast<int>(inputs.size());
  for (int i = 0; i < n; ++i) {
    int64_t out_rows = 0;
    for (int start : starts) out_rows += reinterpret_cast<const int64_t*>(&everyone[start])[i];
    std::vector<int64_t> dims = Dims(inputs[i]);
    if (dims.empty()) dims.push_back(1);
    dims[0] = out_rows;
    TF_Tensor* out = TF_AllocateOutput(ctx, i + 1, TF_TensorType(inputs[i]), dims.data(),
                                       static_cast<int>(dims.size()),
                                       out_rows * pack.row_bytes[i], status);
    if (Fail(ctx, status)) return false;
    int64_t done = 0;
    for (int start : starts) {
      const auto* their_rows = reinterpret_cast<const int64_t*>(&everyone[start]);
      int64_t offset = start + 8 * n;
      for (int j = 0; j < i; ++j) offset += Padded(their_rows[j] * pack.row_bytes[j]);
      const int64_t piece = their_rows[i] * pack.row_bytes[i];
      if (piece > 0) {
        std::memcpy(static_cast<uint8_t*>(TF_TensorData(out)) + done, &everyone[offset], piece);
      }
      done += piece;
    }
    TF_DeleteTensor(out);
  }
  return true;
}

// Allgather: inputs (token, x_1..x_N, any dtypes), outputs (token + 1, each
// x_i concatenated along axis 0 over the ranks, in rank order; rows may
// differ per rank).
void AllgatherCompute(void* kernel, TF_OpKernelContext* ctx) {
  Site& site = *static_cast<Site*>(kernel);
  TF_Status* status = TF_NewStatus();
  const int n = TF_NumInputs(ctx) - 1;
  const int64_t token = ReadToken(ctx, status);
  std::vector<TF_Tensor*> inputs = Inputs(ctx, n, status);
  if (TF_GetCode(status) == TF_OK) {
    std::vector<uint8_t>& mine = site.scratch;
    const Rows pack = Pack(inputs, &mine);
    bool carried = false;
    std::vector<uint8_t> everyone;
    std::vector<int> starts;
    if (Agree(ctx, site, token, mine.data(), static_cast<int64_t>(mine.size()), &carried,
              pack.total_rows) &&
        Gather(ctx, site, mine, carried, &everyone, &starts) &&
        Unpack(ctx, inputs, pack, everyone, starts, status)) {
      SetToken(ctx, site, status);
    }
  }
  for (TF_Tensor* input : inputs) TF_DeleteTensor(input);
  TF_DeleteStatus(status);
}

struct Registration {
  Registration() {
    RegisterOp("MpiStrategyAllgather", "inputs: T", "outputs: T", false, &Run<&AllgatherCompute>,
               "T: list(type)");
  }
} registration;

}  // namespace
}  // namespace mpi_strategy_kernels
