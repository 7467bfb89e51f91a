// Whether checkpoint.output_dir is one filesystem for every rank of the job: clusters often give
// each node its own scratch disk, and what one rank writes there (the embedded default's base,
// exports, resume checkpoints) the others then cannot see.
#pragma once

#include <c10/core/Device.h>

#include <string>

#include "qlora/engine/process_group.h"

namespace qlora::train {

// Rank 0 writes a marker with a fresh random token into `dir` (which every rank has created);
// after a collective every rank looks for it, and a second one sums who missed it. True when every
// rank saw the token; a world of one is trivially shared. Collective: every rank calls it.
bool output_dir_is_shared(engine::World& world, const std::string& dir, c10::Device device);

}  // namespace qlora::train
