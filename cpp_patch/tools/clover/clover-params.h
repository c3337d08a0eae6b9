// A generate call's parameters, prefill and dispatch, and the load plan of an engine (clover-params.cpp). Not
// part of the C API.

#pragma once

#include "clover.h"
#include "clover-offload.h"
#include "clover-run.h"
#include "clover-slot.h"
#include "llama.h"

#include <cstdint>
#include <memory>
#include <string>

// a generate call (clover-params.cpp): the run its parameters describe (nothing is touched on failure), the prompt's
// prefill, and the mode's loop
bool clover_run_init(clover_slot * slot, const clover_gen_params * params, clover_run & run, const llama_token * prompt,
                     int32_t n_prompt, std::string & err);
bool clover_prefill(clover_slot * slot, const llama_token * prompt, int32_t n_prompt, clover_stats * stats);
bool clover_dispatch(clover_run & run);

// everything clover_engine_load hands to llama.cpp, resolved from the engine params and the GGUF header
// (clover-params.cpp); mparams points into offload, so a plan is not copied
struct clover_load_plan {
    clover_model_info    info = {};
    std::string          bd_path;  // the block-diffusion sidecar, or empty
    int32_t              max_block = 0;
    int32_t              n_ctx     = 0;
    int32_t              n_batch   = 0;
    int32_t              n_parallel = 1;
    int32_t              n_graph_cache = 0;
    int32_t              prefill_chunk = 0;
    clover_offload       offload;
    llama_model_params   mparams = {};
    llama_context_params cparams = {};

    clover_load_plan() = default;
    clover_load_plan(const clover_load_plan &) = delete;
    clover_load_plan & operator=(const clover_load_plan &) = delete;
};

// the plan of a load with these params; false with a message naming what is wrong
bool clover_make_load_plan(const char * path, const clover_engine_params & params, clover_load_plan & plan,
                           std::string & err);
// the engine of a plan: model, context and slots; nullptr with a message, and nothing left allocated
std::unique_ptr<clover_engine> clover_engine_make(const char * path, const clover_engine_params & params,
                                                  clover_load_plan & plan, std::string & err);
