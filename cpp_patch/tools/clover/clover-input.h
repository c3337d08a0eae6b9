// The one check of a file a user names to the C tools (llama-clover's -m, --bd, --grammar-file; libclover's model and
// sidecar paths), as clover_common/input_files.py is for the Python tools: a regular file (symbolic links followed),
// at most a size that suits its kind, and otherwise a reason that says what the path is. A fifo would block the
// open, a device or /proc file would read forever, a directory would fail later with a misleading message.
// Header-only: llama-clover uses it without libclover's internal symbols.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>

#ifndef _WIN32
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

// the largest GBNF grammar file the tools read (as clover_common/input_files.py's grammar kind)
constexpr uint64_t CLOVER_MAX_GRAMMAR_FILE_BYTES = 16ull << 20;

// "" when `path` names a regular file of at most max_bytes (0: any size); else why not, to follow the path in a
// message: "no such file", "is a directory, not a file", "is a fifo (named pipe), not a regular file", ...
inline std::string clover_input_file_problem(const char * path, uint64_t max_bytes = 0) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    switch (st.type()) {
        case fs::file_type::regular:   break;
        case fs::file_type::not_found: {
            std::error_code ec_link;
            return fs::is_symlink(fs::symlink_status(path, ec_link)) ?
                "is a symbolic link that leads nowhere (a loop or a missing target)" : "no such file";
        }
        case fs::file_type::directory: return "is a directory, not a file";
        case fs::file_type::fifo:      return "is a fifo (named pipe), not a regular file";
        case fs::file_type::character: return "is a character device, not a regular file";
        case fs::file_type::block:     return "is a block device, not a regular file";
        case fs::file_type::socket:    return "is a socket, not a regular file";
        default:
            return ec ? "cannot be read (" + ec.message() + ")" : "is not a regular file";
    }
    if (max_bytes > 0) {
        const uintmax_t size = fs::file_size(path, ec);
        if (ec) {
            return "cannot be read (" + ec.message() + ")";
        }
        if (size > max_bytes) {
            char buf[128];
            std::snprintf(buf, sizeof(buf), "is %ju bytes, more than the %ju bytes allowed", size, (uintmax_t) max_bytes);
            return buf;
        }
    }
    return "";
}

// the whole of a regular file of at most max_bytes (0: any size) in out, or the reason it cannot be read (as above)
inline std::string clover_read_input_file(const char * path, uint64_t max_bytes, std::string & out) {
    std::string problem = clover_input_file_problem(path, max_bytes);
    if (!problem.empty()) {
        return problem;
    }
    out.clear();
#ifndef _WIN32
    // opened without blocking and checked again: a fifo put in the path's place since the check cannot hang it
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        return std::string("cannot be read (") + std::strerror(errno) + ")";
    }
    struct stat st = {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return "is not a regular file";
    }
    char buf[65536];
    ssize_t n = 0;
    while ((max_bytes == 0 || out.size() <= max_bytes) && (n = read(fd, buf, sizeof(buf))) > 0) {
        out.append(buf, (size_t) n);
    }
    const int read_errno = errno;
    close(fd);
    if (n < 0) {
        return std::string("cannot be read (") + std::strerror(read_errno) + ")";
    }
#else
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        return "cannot be read";
    }
    out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
#endif
    if (max_bytes > 0 && out.size() > max_bytes) {
        return "grew past the " + std::to_string(max_bytes) + " bytes allowed while it was read";
    }
    return "";
}
