// Autocast's mode and policy live with the ops that apply them (include/lockstep/ops/autocast.h);
// this header keeps the amp/ spelling that users coming from torch.amp look for.
#pragma once

#include "lockstep/ops/autocast.h"
