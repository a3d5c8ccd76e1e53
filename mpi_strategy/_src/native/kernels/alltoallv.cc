// MpiStrategyAlltoallv: the alltoall with splits (core/collectives.py
// alltoallv): every rank's splits ride in the agreement (or, when they do
// not fit, follow in one Allgather of int64), then one MPI_Alltoallv of bytes.

#include <cstring>
#include <vector>

#include "common.h"

namespace mpi_strategy_kernels {
namespace {

// What this rank sends in the agreement: its splits (size of them, cut or
// padded with zeros), then 1 if they cut its tensor (`rows` of it; -1 for a
// scalar), else 0.
std::vector<int64_t> Sent(const int64_t* splits, int64_t k, int64_t size, int64_t rows) {
  std::vector<int64_t> sent(size + 1, 0);
  int64_t sum = 0;
  bool fit = k == size;
  for (int64_t r = 0; r < k; ++r) {
    if (r < size) sent[r] = splits[r];
    fit &= splits[r] >= 0;
    sum += splits[r];
  }
  sent[size] = fit && sum == rows;
  return sent;
}

// Every rank's `sent`, one row per rank (from the records, or one Allgather).
bool Matrix(TF_OpKernelContext* ctx, const Site& site, const std::vector<int64_t>& sent,
            bool carried, std::vector<int64_t>* matrix) {
  const int64_t size = site.state->size, width = static_cast<int64_t>(sent.size());
  matrix->resize(size * width);
  if (carried) {
    for (int64_t r = 0; r < size; ++r) {
      std::memcpy(matrix->data() + r * width, CarriedData(site, r), 8 * width);
    }
    return true;
  }
  return MpiOk(ctx, site,
               mpi.Allgather(sent.data(), static_cast<int>(width), mpi.int64, matrix->data(),
                             static_cast<int>(width), mpi.int64,
                             static_cast<Handle>(site.state->data_comm)));
}

// Python's error when some rank's splits do not cut its tensor (false), from
// (protocol.BAD_SPLITS: rows, k, then this rank's k splits, then the matrix); else true.
bool SplitsFit(TF_OpKernelContext* ctx, const Site& site, const std::vector<int64_t>& matrix,
               const int64_t* splits, int64_t k, int64_t rows) {
  const int64_t size = site.state->size;
  bool fit = true;
  for (int64_t r = 0; r < size; ++r) fit &= matrix[r * (size + 1) + size] != 0;
  if (fit) return true;
  std::vector<int64_t> told(sizeof(BadSplitsHead) / 8);
  BadSplitsHead head{};
  head.rows = rows;
  head.k = k;
  std::memcpy(told.data(), &head, sizeof(head));
  told.insert(told.end(), splits, splits + k);
  told.insert(told.end(), matrix.begin(), matrix.end());
  AskPython(ctx, site, kBadSplits, static_cast<int64_t>(told.size()), told.data());
  return false;
}

// Counts and displacements in bytes of `rows` rows each.
void Bytes(const std::vector<int64_t>& rows, int64_t row_bytes, std::vector<int>* counts,
           std::vector<int>* starts) {
  int64_t at = 0;
  for (int64_t n : rows) {
    counts->push_back(static_cast<int>(n * row_bytes));
    starts->push_back(static_cast<int>(at));
    at += n * row_bytes;
  }
}

// Outputs 1 (the rows received, in rank order) and 2 (how many from each
// rank), by one MPI_Alltoallv of bytes.
bool Exchange(TF_OpKernelContext* ctx, const Site& site, TF_Tensor* input,
              const std::vector<int64_t>& matrix, TF_Status* status) {
  const int64_t size = site.state->size, rank = site.state->rank;
  std::vector<int64_t> dims = Dims(input), sent(size), received(size);
  int64_t row_bytes = TF_DataTypeSize(TF_TensorType(input)), total = 0;
  for (size_t d = 1; d < dims.size(); ++d) row_bytes *= dims[d];
  for (int64_t r = 0; r < size; ++r) {
    sent[r] = matrix[rank * (size + 1) + r];
    received[r] = matrix[r * (size + 1) + rank];
    total += received[r];
  }
  dims[0] = total;  // (a scalar's splits never fit: dims has an axis 0 here)
  TF_Tensor* out = TF_AllocateOutput(ctx, 1, TF_TensorType(input), dims.data(),
                                     static_cast<int>(dims.size()), total * row_bytes, status);
  const int64_t one = size;
  TF_Tensor* counts = Fail(ctx, status) ? nullptr
                                        : TF_AllocateOutput(ctx, 2, TF_INT64, &one, 1, 8 * size,
                                                            status);
  bool done = !Fail(ctx, status);
  if (done) {
    std::memcpy(TF_TensorData(counts), received.data(), 8 * size);
    std::vector<int> send_counts, send_starts, recv_counts, recv_starts;
    Bytes(sent, row_bytes, &send_counts, &send_starts);
    Bytes(received, row_bytes, &recv_counts, &recv_starts);
    done = MpiOk(ctx, site,
                 mpi.Alltoallv(TF_TensorData(input), send_counts.data(), send_starts.data(),
                               mpi.byte, TF_TensorData(out), recv_counts.data(),
                               recv_starts.data(), mpi.byte,
                               static_cast<Handle>(site.state->data_comm)));
  }
  if (out != nullptr) TF_DeleteTensor(out);
  if (counts != nullptr) TF_DeleteTensor(counts);
  return done;
}

// Alltoallv: inputs (token, x, splits: int64), outputs (token + 1, the rows
// received in rank order, how many rows came from each rank).
void AlltoallvCompute(void* kernel, TF_OpKernelContext* ctx) {
  Site& site = *static_cast<Site*>(kernel);
  TF_Status* status = TF_NewStatus();
  const int64_t token = ReadToken(ctx, status);
  std::vector<TF_Tensor*> inputs = Inputs(ctx, 2, status);
  if (TF_GetCode(status) == TF_OK) {
    const int64_t size = site.state->size;
    const auto* splits = static_cast<const int64_t*>(TF_TensorData(inputs[1]));
    const int64_t k = TF_TensorElementCount(inputs[1]);
    const int64_t rows = TF_NumDims(inputs[0]) ? TF_Dim(inputs[0], 0) : -1;
    const std::vector<int64_t> sent = Sent(splits, k, size, rows);
    std::vector<int64_t> matrix;
    bool carried = false;
    if (Agree(ctx, site, token, sent.data(), 8 * static_cast<int64_t>(sent.size()), &carried) &&
        Matrix(ctx, site, sent, carried, &matrix) &&
        SplitsFit(ctx, site, matrix, splits, k, rows) &&
        Exchange(ctx, site, inputs[0], matrix, status)) {
      SetToken(ctx, site, status);
    }
  }
  for (TF_Tensor* input : inputs) TF_DeleteTensor(input);
  TF_DeleteStatus(status);
}

struct Registration {
  Registration() {
    RegisterOp("MpiStrategyAlltoallv", "input: T;splits: int64", "output: T;received: int64",
               false, &Run<&AlltoallvCompute>);
  }
} registration;

}  // namespace
}  // namespace mpi_strategy_kernels
