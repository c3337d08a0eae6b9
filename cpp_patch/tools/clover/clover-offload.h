// Offload options, the memory plan and its fit checks, devices (clover-offload.cpp). Not part of the C API.

#pragma once

#include "clover.h"
#include "llama.h"

#include <cstdint>
#include <list>
#include <string>
#include <vector>

// offload options (clover-offload.cpp): the llama_model_params fields that -ot, --cpu-moe, --n-cpu-moe, -sm, -mg
// and -ts set, with the pattern strings they point to; apply() is valid while this object lives
struct clover_offload {
    std::list<std::string>                         patterns;   // stable addresses for overrides[i].pattern
    std::vector<llama_model_tensor_buft_override>  overrides;  // {nullptr, nullptr}-terminated, or empty
    std::vector<float>                             tensor_split;  // llama_max_devices() entries, or empty
    llama_split_mode split_mode = LLAMA_SPLIT_MODE_LAYER;
    int32_t          main_gpu   = 0;

    clover_offload() = default;
    clover_offload(const clover_offload &) = delete;  // overrides point into patterns
    clover_offload & operator=(const clover_offload &) = delete;
    clover_offload & operator=(clover_offload &&) = default;  // std::list keeps its nodes (and c_str()s) on move

    void apply(llama_model_params & mp) const;
};

// false with a message naming the option (its engine-params field and llama.cpp's flag) when it cannot be satisfied
bool    clover_offload_resolve(const clover_engine_params & p, int32_t n_layer, clover_offload & out, std::string & err);
// the GPU devices (discrete and integrated) of the backend registry
int32_t clover_n_gpu_devices();
// false with a message naming -np when the host entry's context and compute buffers exceed its free memory less
// the margin
bool    clover_check_host_fit(const std::vector<clover_device_memory> & devs, int32_t margin_mib, int32_t n_parallel,
                              std::string & err);
// per-device memory of a load with these params, from llama.cpp's no_alloc dry run; the host entry is last
bool    clover_plan_memory(const char * path, const llama_model_params & mparams, const llama_context_params & cparams,
                           std::vector<clover_device_memory> & out, std::string & err);
