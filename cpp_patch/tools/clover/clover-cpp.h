#pragma once

// C++ helpers over the C API of clover.h, as llama.cpp's llama-cpp.h does for llama.h.

#include "clover.h"

#include <memory>

struct clover_engine_deleter {
    void operator()(clover_engine * eng) const { clover_engine_free(eng); }
};

typedef std::unique_ptr<clover_engine, clover_engine_deleter> clover_engine_ptr;
