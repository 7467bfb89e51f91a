// FSDP-style sharding of a loaded DecoderModel over a World's mesh.
//
// Shard groups, as the recipe wraps them: the token embedding; each decoder layer's frozen part
// (its NF4 projections' codes, scalers, factors and means, and its two norms) as one byte buffer;
// final norm + output projection; and, separately, each layer's LoRA adapters (and the output
// projection's, when adapted) as one fp32 buffer. Every buffer is a FlatLayout padded to split
// evenly over the shard group, so any number of ranks works for any shape.
//
// Frozen groups live as this rank's shard only. Before a unit runs, its group is all-gathered
// (packed NF4 bytes, never dequantized weights) into a full buffer whose typed views the model's
// tensors already are; the next unit's gather is issued asynchronously meanwhile (forward order in
// forward, reverse in backward). After the unit's forward the full buffer's storage is released
// (reshard_after_forward; the last layer and the head stay, backward needs them next) and gathered
// again for backward; activation-checkpoint replays find it gathered by before_backward.
//
// Trainable groups stay gathered (adapters are ~1% of a 7B base): each rank keeps the full fp32
// adapters for compute plus its shard as the optimizer's master copy. Gradients accumulate into a
// full per-group gradient buffer (the adapters' .grad are views of it); when a group's last
// gradient of the step's last micro-batch is accumulated (a post-hook on the AccumulateGrad nodes),
// its buffer is reduce-scattered asynchronously within the shard group, overlapping the rest of
// backward, then all-reduced across replicas (HSDP). finish_backward() waits for them in the order
// they became ready. The optimizer steps the flat shards; gather_params() all-gathers them back.
//
// A vision tower (add_tower) is sharded the same way: each encoder layer's frozen part is a group, and
// one more holds the rest (patch embedding, positions, post-norm, a frozen projector), which forward
// needs at both ends; the tower calls the engine around each of these units (vision::Tower::hooks),
// the next layer's gather prefetched. Its trainable group (its adapters, a trained projector) is the
// last one. Not every rank runs the tower each time: one whose batch holds no image calls
// vision::skip_forward instead (the same gathers), and when the tower trains, finish_backward makes
// the gathers of the tower's backward that such a rank never ran (the tower's backward runs after
// every other collective of the decoder's, so the ranks' sequences pair up).
//
// A shard group of one rank (one process: a world of one; or shard_size 1) is the same engine with
// nothing to move: frozen tensors stay as loaded (no buffer, no gather, no release), the trainable
// groups' full buffers are the optimizer's shards and their gradients, and only replicas (if any)
// all-reduce. Gradient clipping then follows torch's clip_grad_norm_ over the adapters, so one
// process computes bit for bit what the per-adapter loop of earlier releases did.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qlora/engine/flat_layout.h"
#include "qlora/engine/process_group.h"
#include "qlora/models/decoder.h"
#include "qlora/models/vision/tower.h"

namespace torch::autograd {
struct Node;
}

namespace qlora::engine {

struct ShardingOptions {
  bool reshard_after_forward = true;
  bool prefetch = true;  // off: every gather is issued when needed and waited at once (for benchmarks)
  // Reduce-scatter every micro-batch's gradients (less memory held between micro-batches in a
  // future layout; same results) instead of only the last one's.
  bool reduce_scatter_every_micro_batch = false;
};

struct ShardStats {
  int64_t gathers = 0;
  int64_t bytes_gathered = 0;  // every frozen-group all-gather (full buffer sizes)
  // Of those, the decoder layers' groups (NF4 projections + norms), and what the same layers
  // would move as bf16 weights; the embedding and head are dense and move as stored.
  int64_t layer_bytes_gathered = 0;
  int64_t layer_bytes_as_bf16 = 0;
  // Of those, the vision tower's groups (forward, backward and skip_forward's).
  int64_t tower_gathers = 0;
  int64_t tower_bytes_gathered = 0;
  int64_t reduce_scatters = 0;
};

class ShardedDecoder : public models::UnitHooks, public std::enable_shared_from_this<ShardedDecoder> {
 public:
  // `model` was loaded identically on every rank (same seed: same adapters). Afterwards each rank
  // holds 1/shard_size of every group, and model.hooks points to the returned engine.
  static std::shared_ptr<ShardedDecoder> shard(models::DecoderModel& model, World& world, ShardingOptions options);

  // The same in two parts, so a loader can hand over each layer as it is built and the full base
  // never exists on one rank: begin(); shard_layer() from DecoderLoadOptions::on_layer_loaded for
  // every layer, in order; finish(model) once load_decoder has returned (embedding, head, hooks).
  static std::shared_ptr<ShardedDecoder> begin(World& world, ShardingOptions options);
  void shard_layer(int64_t index, modules::DecoderLayer& layer, const models::Architecture& arch);
  void finish(models::DecoderModel& model);
  // After finish(), before the optimizer is made, once LoRA and the projector's training are on it:
  // shards the tower's frozen tensors (a group per encoder layer, one for the rest) and sets its hooks;
  // its trainable tensors (its encoder linears' adapters, the projector's fp32 copy:
  // vision::tower_trainable's, in that order) become the last trainable group. Its gradients come
  // last in backward, and a rank whose micro-batch held no image gets none: the group's
  // reduce-scatter is issued by finish_backward on every rank, after the others' (zeros where none
  // arrived).
  void add_tower(models::vision::Tower& tower);
  // The bytes of the tower's frozen tensors this rank holds between uses (its shards; one rank: all).
  int64_t tower_bytes_held() const;
  ~ShardedDecoder() override;

  // One fp32 tensor per trainable group: this rank's shard of the adapters, with .grad set to the
  // reduce-scattered gradient after finish_backward(). Step these with the optimizer.
  const std::vector<at::Tensor>& param_shards() const { return param_shards_; }
  // Names of the members of trainable group g, in layout order (for state dicts).
  const FlatLayout& trainable_layout(size_t g) const;

  // False for every micro-batch but the last of a step: gradients only accumulate locally.
  void set_gradient_sync(bool sync) { sync_ = sync; }
  // After every backward (every micro-batch's): frees the gathered frozen groups; where gradients
  // were reduce-scattered (the step's last micro-batch, or every one), waits for those collectives
  // in ready order, adds them into the shards and zeroes the full gradient buffers. Throws if a
  // group did not get each adapter's gradient exactly once.
  void finish_backward();
  // torch's clip_grad_norm_ over the global gradient (one all-reduce of the squared shard norms);
  // returns the norm before clipping. max_norm <= 0 only measures.
  double clip_grad_norm(double max_norm);
  // After the optimizer step: the updated shards become the model's adapters on every rank.
  void gather_params();

  // Resume: this rank's shard of group g's unpadded vector (padded for this mesh and cut), and the
  // adapters set from every group's unpadded vector (then all-gathered into the model).
  at::Tensor shard_of_unpadded(size_t g, const at::Tensor& unpadded) const;
  void load_params(const std::vector<at::Tensor>& unpadded);

  // Gathers unit's frozen group to shard rank `root` only (a collective of the shard group: every
  // member calls it, in the same order); root keeps it until release_unit(). For writers.
  WorkPtr gather_unit_to(int64_t unit, int root);
  void release_unit(int64_t unit);

  // Gathers every frozen group and keeps it, through forwards too, until reshard_all() releases
  // them: exports, and GRPO's rollouts (a decode step per token would otherwise gather every layer,
  // and ranks whose sequences ended would have to keep stepping to join those collectives).
  void unshard_all();
  void reshard_all();
  // The same for the tower's groups only (a merged export reads its adapted linears' bases).
  void unshard_tower();
  void reshard_tower();
  const ShardStats& stats() const { return stats_; }

  void before_forward(int64_t unit, bool recompute) override;
  void after_forward(int64_t unit, bool recompute) override;
  void before_backward(int64_t unit) override;
  void after_backward(int64_t unit) override;

  struct FrozenGroup;
  struct TrainGroup;
  struct TowerHooks;

 private:
  // A model's units -1..layers in frozen_ from slot `first` (unit u: slot first + u + 1); an empty
  // slot is the head's group (a tied embedding; the tower's rest).
  struct Units {
    size_t first = 0;
    int64_t layers = 0;
    bool tower = false;
  };
  Units decoder_units() const { return {0, num_layers_, false}; }
  ShardedDecoder(World& world, ShardingOptions options);
  FrozenGroup& group_of(int64_t unit) { return group_of(decoder_units(), unit); }
  FrozenGroup& group_of(const Units& s, int64_t unit);
  void gather(FrozenGroup& g, bool wait_now);
  void ensure(FrozenGroup& g);
  void release(FrozenGroup& g);
  void prefetch(const Units& s, int64_t unit);
  void forward_begin(const Units& s, int64_t unit, bool recompute);
  void forward_end(const Units& s, int64_t unit, bool recompute);
  void backward_begin(const Units& s, int64_t unit);
  void backward_end(const Units& s, int64_t unit);
  // The tower's backward hooks, in order, for each tower forward with gradients whose backward did
  // not run here (a rank without images ran skip_forward).
  void skip_tower_backwards();
  void on_grad_ready(size_t group);
  // The adapters of `layers` (named stems[k].lora_A ...), then `more` (a MoE layer's expert adapters), as one group.
  // late: the group may get no gradient in a backward (add_tower).
  void add_trainable(const std::vector<modules::LoraLinear*>& layers, const std::vector<std::string>& stems,
                     const std::vector<std::pair<at::Tensor*, std::string>>& more = {}, bool late = false);
  // Issues group gi's reduce-scatter (where the shard group has several ranks) and queues it for finish_backward.
  void reduce(size_t gi);
  // Whether this backward's gradients are reduced (the step's last micro-batch, or every one).
  bool reducing() const { return sync_ || opt_.reduce_scatter_every_micro_batch; }
  // A shard group of one rank (one process, or pure replication): every group stays whole where
  // it is; gathers, releases and reduce-scatters do nothing.
  bool whole() const { return world_.shard().size() == 1; }

  World& world_;
  ShardingOptions opt_;
  // Slot unit + 1: the embedding, the layers, the head. A tied embedding lives in the head's
  // group and its own slot stays empty.
  std::vector<std::unique_ptr<FrozenGroup>> frozen_;
  std::vector<std::unique_ptr<TrainGroup>> train_;
  std::vector<at::Tensor> param_shards_;
  std::vector<at::Tensor> adapters_;  // the model's LoRA tensors (views of the groups' full buffers)
  std::vector<size_t> ready_order_;
  bool sync_ = true;
  bool held_ = false;  // unshard_all(): no release until reshard_all()
  int64_t num_layers_ = 0;  // layers sharded so far; all of them after finish()
  Units tower_{0, -1, true};  // layers -1 until add_tower
  int64_t tower_first_adapted_ = 0;  // the first encoder layer with LoRA (tower_.layers: none)
  int64_t tower_backwards_due_ = 0;  // tower forwards with gradients whose backward has not run
  ShardStats stats_;
};

}  // namespace qlora::engine
