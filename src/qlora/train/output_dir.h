// Which ranks of the job see the same checkpoint.output_dir. Clusters often give each node its own
// scratch disk: then what one rank writes there the ranks of other nodes cannot see, and each
// directory needs its own writer (of the embedded default's base, of resume checkpoints' commits)
// while the exports are written into rank 0's directory only.
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <vector>

#include "qlora/engine/process_group.h"

namespace qlora::train {

// One entry per rank: the lowest rank that sees the same directory (its directory's lead).
struct OutputDirs {
  std::vector<int> lead_of;

  bool shared() const;              // one directory for every rank (a world of one included)
  int count() const;                // how many distinct directories
  bool leads(int rank) const { return lead_of.at(static_cast<size_t>(rank)) == rank; }
  std::vector<int> ranks_with(int rank) const;  // the ranks that see `rank`'s directory, ascending
  std::vector<bool> sees_dir_of(int rank) const;  // [r]: r sees `rank`'s directory
  std::string describe() const;     // "2 directories: ranks 0-1, ranks 2-3"
};

// "rank 3", "ranks 0-3" for a contiguous run, else "ranks 0, 2, 5".
std::string rank_list(const std::vector<int>& ranks);

// Every rank writes a marker with a fresh random token into `dir` (which every rank has created);
// after a collective each rank looks for every rank's marker, and a second one shares what each
// saw. Ranks that see one another's markers share a directory. A rank that sees some but not all
// of another directory's markers (a filesystem that is neither shared nor local) is an error
// naming the directory and the ranks. Collective: every rank calls it.
OutputDirs find_output_dirs(engine::World& world, const std::string& dir, c10::Device device);

}  // namespace qlora::train
