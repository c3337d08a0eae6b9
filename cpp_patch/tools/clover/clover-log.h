#pragma once

// libclover's messages go through llama.cpp's log callback (what llama_log_set installed, which the Python
// bindings listen to), as llama.cpp's own messages do; stderr only when no callback is set.

#include "ggml.h"

#include <string>

std::string clover_format(const char * fmt, ...);
void        clover_log(ggml_log_level level, const char * fmt, ...);
