// libclover's messages (clover-log.h): formatted like printf, and sent through llama.cpp's log callback.

#include "clover-log.h"

#include "llama.h"

#include <cstdarg>
#include <cstdio>
#include <string>

static std::string clover_vformat(const char * fmt, va_list args) {
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, args);
    return buf;
}

std::string clover_format(const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::string out = clover_vformat(fmt, args);
    va_end(args);
    return out;
}

void clover_set_err(char * err, size_t err_size, const std::string & msg) {
    if (err && err_size > 0) {
        snprintf(err, err_size, "%s", msg.c_str());
    }
}

void clover_log(ggml_log_level level, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    const std::string buf = clover_vformat(fmt, args);
    va_end(args);
    ggml_log_callback cb = nullptr;
    void * user_data = nullptr;
    llama_log_get(&cb, &user_data);
    if (cb) {
        cb(level, buf.c_str(), user_data);
    } else {
        fputs(buf.c_str(), stderr);
    }
}
