// The data layer in one include: datasets, transforms, IDX/MNIST readers, token files and text
// corpora, samplers, DataLoader.
#pragma once

#include "lockstep/data/dataloader.h"
#include "lockstep/data/dataset.h"
#include "lockstep/data/idx.h"
#include "lockstep/data/mnist.h"
#include "lockstep/data/sampler.h"
#include "lockstep/data/text_corpus.h"
#include "lockstep/data/token_file.h"
