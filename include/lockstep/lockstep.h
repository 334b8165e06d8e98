// The whole public API in one include.
#pragma once

#include "lockstep/autograd/engine.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/autograd/gradcheck.h"
#include "lockstep/autograd/node.h"
#include "lockstep/error.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/ops/linalg.h"
#include "lockstep/ops/nn.h"
#include "lockstep/ops/parallel.h"
#include "lockstep/ops/reduce.h"
#include "lockstep/ops/shape.h"
#include "lockstep/tensor/tensor.h"
