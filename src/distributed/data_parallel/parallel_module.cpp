// ParallelModule's scopes (parallel_module.h): each wrapper says what entering and leaving means.
#include "lockstep/distributed/parallel_module.h"

namespace lockstep::dist {

ParallelModule::NoSync::NoSync(ParallelModule& model)
    : model_(model), previous_(model.set_no_sync(true)) {}

ParallelModule::NoSync::~NoSync() { model_.set_no_sync(previous_); }

ParallelModule::FullParams::FullParams(ParallelModule& model) : model_(model) {
  model_.gather_full_params();
}

ParallelModule::FullParams::~FullParams() { model_.release_full_params(); }

}  // namespace lockstep::dist
