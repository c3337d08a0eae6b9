// Auto mode (clover-auto.cpp): llama.cpp's speculative framework drafts, libclover verifies. Not part of the C API.

#pragma once

#include "speculative.h"  // common/

#include <cstdint>
#include <string>

struct clover_run;

// The drafters of an engine's auto mode, shared by its slots: one common_speculative whose sequence i is slot i's
// history, with llama-server's `--spec-type ngram-mod,draft-clover` (ngram-mod alone for a file without block
// passes). Made by the first auto call; `error` keeps why that failed.
struct clover_drafter {
    int32_t                n_seq = 0;
    common_speculative_ptr spec;
    std::string            error;
};

bool clover_run_auto(clover_run & run);
