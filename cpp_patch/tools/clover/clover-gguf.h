// GGUF header reads: the clover settings of a model file and its sidecar, the layer count (clover-gguf.cpp). Not
// part of the C API.

#pragma once

#include "clover.h"

#include <cstdint>
#include <string>

// GGUF headers (clover-gguf.cpp)
// general.architecture is one of spec v2's spellings (clover_moe, clover-moe, clovermoe); else false and a message
// (the retired v1 'clover' gets one that names v2)
bool    clover_check_arch(const char * path, const std::string & arch, std::string & err);
// the clover settings of a model file, and of its block-diffusion sidecar when bd_path is not NULL or empty;
// false with a message naming the file and the key
bool    clover_read_info(const char * path, const char * bd_path, clover_model_info & info, std::string & err);
// <arch>.block_count of a GGUF, or -1 with a message
int32_t clover_gguf_n_layer(const char * path, std::string & err);
