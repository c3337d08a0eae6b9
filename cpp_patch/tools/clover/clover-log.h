#pragma once

// libclover's messages go through llama.cpp's log callback (what llama_log_set installed, which the Python
// bindings listen to), as llama.cpp's own messages do; stderr only when no callback is set.

#include "ggml.h"

#include <cstddef>
#include <string>

std::string clover_format(const char * fmt, ...);
// a C API function's message for its caller: msg into err (err_size bytes, truncated), when err is not NULL
void        clover_set_err(char * err, size_t err_size, const std::string & msg);
void        clover_log(ggml_log_level level, const char * fmt, ...);
