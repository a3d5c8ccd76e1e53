// The communicators' shared state, owned here and found by engine id.
//
// A kernel holds its communicator's engine id (the op attribute `engine`),
// never an address: a graph may outlive its communicator, or come from
// another process (an imported GraphDef), and an address would then point at
// freed or foreign memory. Python opens a block per communicator (State, then
// the announcements) and reads and writes it through a numpy view; closing it
// (when that view is gone) drops the registry's reference, and the memory
// goes with the last kernel still running on it.

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace mpi_strategy_kernels {
namespace {

std::mutex registry_mutex;

std::unordered_map<int64_t, std::shared_ptr<Block>>& Registry() {
  static auto* registry = new std::unordered_map<int64_t, std::shared_ptr<Block>>;
  return *registry;  // (never destroyed: kernels may run while the process exits)
}

// Whether MPI may still read the announcements' send buffer (a send not
// known to be complete): then the block is kept for as long as the process.
bool SendsPending(Block& block) {
  State& state = *reinterpret_cast<State*>(block.words.data());
  if (state.announce_comm == 0 || mpi.Test == nullptr) return false;
  auto* requests = reinterpret_cast<Handle*>(block.words.data() + kStateFields + state.size + 1);
  alignas(16) unsigned char status[64];
  for (int64_t r = 0; r < state.size; ++r) {
    int done = 0;
    if (requests[r] != 0 && (mpi.Test(&requests[r], &done, status) != 0 || !done)) return true;
  }
  return false;
}

}  // namespace

std::shared_ptr<Block> Held(int64_t engine) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto found = Registry().find(engine);
  return found == Registry().end() ? nullptr : found->second;
}

}  // namespace mpi_strategy_kernels

using namespace mpi_strategy_kernels;  // NOLINT

// A zeroed block of `words` int64 for communicator `engine` (nullptr if the
// id is taken or `words` cannot hold a State).
extern "C" int64_t* mpi_strategy_state_open(int64_t engine, int64_t words) {
  if (words < kStateFields) return nullptr;
  auto block = std::make_shared<Block>();
  block->words.assign(static_cast<size_t>(words), 0);
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (!Registry().emplace(engine, block).second) return nullptr;
  return block->words.data();
}

// Python is done with `engine`'s block; kernels find the communicator gone.
extern "C" void mpi_strategy_state_close(int64_t engine) {
  std::shared_ptr<Block> block;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto found = Registry().find(engine);
    if (found == Registry().end()) return;
    block = std::move(found->second);
    Registry().erase(found);
  }
  if (SendsPending(*block)) new std::shared_ptr<Block>(block);
}

// How many blocks are open (for the tests: a closed communicator frees its own).
extern "C" int64_t mpi_strategy_states_open() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return static_cast<int64_t>(Registry().size());
}
