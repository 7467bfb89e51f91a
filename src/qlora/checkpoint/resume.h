// Resume checkpoints: a training-agnostic bag of named tensors plus JSON metadata, committed
// atomically and verified on load.
//
//   <output_dir>/checkpoints/step_<global_step:08d>/
//       rank_<k:05d>.safetensors  rank k's tensors (CPU, any dtype the safetensors layer supports,
//                           e.g. uint8 RNG states, int64 counters, fp32 moments); one process
//                           writes rank_00000 alone
//       meta.json           free-form JSON from the caller
//       manifest.json       {"format":"qlora-resume-v1","step":N,"world_size":W,"mesh":{..},
//                            "files":{"rank_00000.safetensors":{"bytes":..,"xxh64":"<16 hex>"},...}}
//                           with node-local output dirs also "ranks_here":[k,..]: the ranks
//                           whose files this directory holds (the others are in other nodes')
//
// The checksum is XXH64 (seed 0, hex) over each file's bytes (xxh64.h): a resume state of a few
// hundred MB is hashed at memory speed, and it catches the torn or bit-rotten files we care about
// (it is not a defence against tampering).
//
// Commit protocol: everything is written into step_N.tmp/ (each file written aside, fsynced and
// renamed by the safetensors layer), manifest.json last; then the directory is renamed to step_N
// and checkpoints/ is fsynced. Only once every directory has committed are older checkpoints
// pruned (so a crash between two nodes' commits leaves every node its previous checkpoint). A directory without a
// manifest is never a checkpoint, so a crash at any point leaves the previous checkpoints usable.
// Replacing an existing step_N without RENAME_EXCHANGE takes two renames (step_N -> step_N.old,
// step_N.tmp -> step_N); a crash between them leaves only step_N.old, which therefore counts as
// step N while step_N itself is absent or incomplete, and the next successful save moves it back
// or removes it. So a crash at any point leaves that step's previous copy or an older step.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace qlora::checkpoint {

struct ResumeState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // order is preserved by a round trip
  nlohmann::json meta;
};

// Every message names the checkpoint directory and, where one is involved, the file.
struct ResumeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Multi-rank runs and one process alike (one process is rank 0 of 1): one checkpoint directory
// for the job, each rank's tensors in rank_<k:05d>.safetensors, meta.json from rank 0, the
// manifest (with world_size and the mesh) listing and checksumming every rank's file. Every rank
// calls save with its own state; `barrier` must be a barrier of all of them (empty: one process).
struct RankSync {
  int rank = 0;
  int world_size = 1;
  std::function<void()> barrier;
  nlohmann::json mesh = nlohmann::json::object();  // recorded in the manifest (e.g. {"shard_size": 2})
  // Node-local output dirs: the rank that commits in this rank's directory, and the ranks whose
  // files go there (ascending). Empty: one directory shared by every rank, committed by rank 0.
  int lead = 0;
  std::vector<int> ranks_here;
};

// Rank 0 (each directory's lead) commits only after every rank's file is durable, so a rank that dies mid-save leaves the
// earlier checkpoints as they were. Saving a step that already exists replaces it atomically
// (Linux renameat2 RENAME_EXCHANGE; where that is unavailable the old one is moved aside to
// step_N.old first, see above). Asides left by an earlier crash are settled after the commit.
// keep_last_n > 0: afterwards only the keep_last_n newest complete checkpoints (by step) remain,
// and the one just written is never removed; keep_last_n <= 0 keeps all. A pruned directory
// loses its manifest first, so one half-deleted by a crash is not mistaken for a checkpoint.
// Tensors may live on any device (copied to CPU). A floating tensor holding NaN or inf is refused
// (ResumeError naming it) before anything is written: nothing non-finite is ever saved.
void save_resume_checkpoint(const std::string& output_dir, int64_t global_step, const ResumeState& mine,
                            int64_t keep_last_n, const RankSync& sync = {});

// Newest <output_dir>/checkpoints/step_<digits> whose manifest.json exists, parses and names that
// step (step_<digits>.old where that is the step's only such directory); nullopt if none.
// Leftover step_*.tmp directories (a save that crashed) are ignored, not removed: they may be the
// only trace of what went wrong, and the next save of that step replaces them. Only the manifest
// is checked here; load_resume_checkpoint verifies the data.
std::optional<std::string> latest_resume_checkpoint(const std::string& output_dir);
// All of them (as latest_resume_checkpoint finds them), newest first.
std::vector<std::string> resume_checkpoints(const std::string& output_dir);

// Moves a checkpoint that failed to load (load_resume_checkpoint threw) to <dir>.damaged (or
// .damaged.1, ...): kept for inspection, no longer a checkpoint, so neither resume nor
// keep_last_n counts it. Returns where it went.
std::string set_aside_damaged(const std::string& dir);
// The same with another reason as the suffix (<dir>.<reason>, or .<reason>.1, ...).
std::string set_aside(const std::string& dir, const std::string& reason);

struct ResumeCheckpoint {
  nlohmann::json meta;
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> ranks;  // [rank] -> its tensors, in saved order
  // Written by the single-process recipe of qlora before the engine was one for 1..N ranks
  // (state.safetensors with per-adapter names): ranks[0] holds its tensors, named as it named
  // them; the engine converts them (engine/sharded_state.h).
  bool legacy_single_process = false;
  // Written with node-local output dirs: the ranks whose files this directory holds; ranks[k] of
  // every other rank k is empty (engine/sharded_state.h shares them between the nodes). Empty:
  // every rank's file is here.
  std::vector<int> ranks_here;
  int world_size = 1;
};
// Verifies the size and XXH64 of every file listed in the manifest before reading anything, and
// reads every rank's file that the directory holds (all of them unless ranks_here) (a run on another number of ranks needs pieces of every old rank's
// state to build its own). Throws ResumeError naming the file and the checkpoint on a mismatch, a
// missing file or a missing manifest. Tensors come back on the CPU, owning their memory.
ResumeCheckpoint load_resume_checkpoint(const std::string& dir);
// The step a checkpoint directory's manifest names (as resume_checkpoints lists them).
int64_t resume_checkpoint_step(const std::string& dir);

// Puts the complete directory `tmp` at `final_dir`: a plain rename, or where final_dir exists an
// atomic swap (renameat2 RENAME_EXCHANGE; else move-aside) after which the replaced directory is
// removed; the parent is fsynced. Shared by the resume and export commits.
void commit_directory(const std::string& tmp, const std::string& final_dir);

}  // namespace qlora::checkpoint
