// The GGUF side of the engine: the clover settings read as typed values from a model file, and from a
// block-diffusion sidecar (spec v2 section 5), with the sidecar's trunk fingerprint; the layer count the offload
// options are checked against.

#include "clover.h"
#include "clover-gguf.h"
#include "clover-input.h"
#include "clover-log.h"

#include "gguf.h"
#include "llama.h"

#include "hash/hash.h"
#include "../../src/clover-keys.h"  // the block-diffusion keys: one table with the model loader

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {
struct gguf_deleter {
    void operator()(gguf_context * ctx) const { gguf_free(ctx); }
};
using gguf_ptr = std::unique_ptr<gguf_context, gguf_deleter>;
}

static bool clover_gguf_int(const gguf_context * gctx, const char * key, int64_t & out) {
    const int64_t id = gguf_find_key(gctx, key);
    if (id < 0) {
        return false;
    }
    switch (gguf_get_kv_type(gctx, id)) {
        case GGUF_TYPE_UINT8:  out = gguf_get_val_u8 (gctx, id); return true;
        case GGUF_TYPE_INT8:   out = gguf_get_val_i8 (gctx, id); return true;
        case GGUF_TYPE_UINT16: out = gguf_get_val_u16(gctx, id); return true;
        case GGUF_TYPE_INT16:  out = gguf_get_val_i16(gctx, id); return true;
        case GGUF_TYPE_UINT32: out = gguf_get_val_u32(gctx, id); return true;
        case GGUF_TYPE_INT32:  out = gguf_get_val_i32(gctx, id); return true;
        case GGUF_TYPE_UINT64: out = (int64_t) gguf_get_val_u64(gctx, id); return true;
        case GGUF_TYPE_INT64:  out = gguf_get_val_i64(gctx, id); return true;
        default: return false;
    }
}

static bool clover_gguf_float(const gguf_context * gctx, const char * key, float & out) {
    const int64_t id = gguf_find_key(gctx, key);
    if (id < 0) {
        return false;
    }
    switch (gguf_get_kv_type(gctx, id)) {
        case GGUF_TYPE_FLOAT32: out = gguf_get_val_f32(gctx, id); return true;
        case GGUF_TYPE_FLOAT64: out = (float) gguf_get_val_f64(gctx, id); return true;
        default: return false;
    }
}

// an array of numbers as doubles; false if missing or not numeric
static bool clover_gguf_num_array(const gguf_context * gctx, const char * key, std::vector<double> & out) {
    const int64_t id = gguf_find_key(gctx, key);
    if (id < 0 || gguf_get_kv_type(gctx, id) != GGUF_TYPE_ARRAY) {
        return false;
    }
    const size_t n    = gguf_get_arr_n(gctx, id);
    const auto   type = gguf_get_arr_type(gctx, id);
    out.clear();
    // gguf_get_arr_data asserts on arrays of strings (and nested arrays): check the element type first
    if (type == GGUF_TYPE_STRING || type == GGUF_TYPE_ARRAY || type == GGUF_TYPE_BOOL) {
        return false;
    }
    if (n == 0) {
        return true;
    }
    const void * data = gguf_get_arr_data(gctx, id);
    for (size_t i = 0; i < n; ++i) {
        switch (type) {
            case GGUF_TYPE_UINT8:   out.push_back(((const uint8_t  *) data)[i]); break;
            case GGUF_TYPE_INT8:    out.push_back(((const int8_t   *) data)[i]); break;
            case GGUF_TYPE_UINT16:  out.push_back(((const uint16_t *) data)[i]); break;
            case GGUF_TYPE_INT16:   out.push_back(((const int16_t  *) data)[i]); break;
            case GGUF_TYPE_UINT32:  out.push_back(((const uint32_t *) data)[i]); break;
            case GGUF_TYPE_INT32:   out.push_back(((const int32_t  *) data)[i]); break;
            case GGUF_TYPE_UINT64:  out.push_back((double) ((const uint64_t *) data)[i]); break;
            case GGUF_TYPE_INT64:   out.push_back((double) ((const int64_t  *) data)[i]); break;
            case GGUF_TYPE_FLOAT32: out.push_back(((const float    *) data)[i]); break;
            case GGUF_TYPE_FLOAT64: out.push_back(((const double   *) data)[i]); break;
            default: return false;
        }
    }
    return true;
}

// why gguf_init_from_file refused a file: it cannot be opened, it is no GGUF at all, or it is a damaged GGUF (gguf's
// own reason is in llama.cpp's log, which the caller may add)
static std::string clover_gguf_open_error(const char * path) {
    FILE * f = std::fopen(path, "rb");
    if (!f) {
        return clover_format("cannot open '%s': %s", path, std::strerror(errno));
    }
    char magic[4] = {};
    const size_t n = std::fread(magic, 1, sizeof(magic), f);
    std::fclose(f);
    if (n != sizeof(magic) || std::memcmp(magic, "GGUF", 4) != 0) {
        return clover_format("'%s' is not a GGUF file (it does not start with the GGUF magic)", path);
    }
    return clover_format("'%s' is a damaged GGUF file: its header, metadata or tensor infos cannot be read", path);
}

// The data section must end where the file ends (after the last tensor's alignment padding, which GGUF writers
// add): a header whose tensor count or tensor infos do not match the file would otherwise load with every
// weight read from the wrong bytes.
static bool clover_check_data_size(const char * path, const gguf_context * gctx, std::string & err) {
    FILE * f = std::fopen(path, "rb");
    if (!f || std::fseek(f, 0, SEEK_END) != 0) {
        if (f) {
            std::fclose(f);
        }
        err = clover_format("cannot read '%s': %s", path, std::strerror(errno));
        return false;
    }
    const long file_size = std::ftell(f);
    std::fclose(f);
    const size_t align = gguf_get_alignment(gctx);
    size_t end = gguf_get_data_offset(gctx);
    for (int64_t i = 0; i < gguf_get_n_tensors(gctx); ++i) {
        end = std::max(end, gguf_get_data_offset(gctx) + gguf_get_tensor_offset(gctx, i) + gguf_get_tensor_size(gctx, i));
    }
    const size_t padded = align > 0 ? (end + align - 1) / align * align : end;
    if (file_size < 0 || ((size_t) file_size != end && (size_t) file_size != padded)) {
        err = clover_format("'%s': the tensor data of the %lld tensors in its header ends at byte %zu, but the file has %ld bytes: "
                "the tensor count or the tensor infos do not match the file", path,
                (long long) gguf_get_n_tensors(gctx), padded, file_size);
        return false;
    }
    return true;
}

bool clover_check_arch(const char * path, const std::string & arch, std::string & err) {
    if (arch == "clover_moe" || arch == "clover-moe" || arch == "clovermoe") {
        return true;
    }
    if (arch == "clover") {
        err = clover_format("'%s': clover: architecture 'clover' is spec v1, which is retired; convert the checkpoint "
                "again with clover-convert (spec v2, arch clover_moe)", path);
    } else {
        err = clover_format("'%s': general.architecture is '%s', not 'clover_moe' (clover-convert and llama.cpp's "
                "Clover converter make clover_moe GGUF files)", path, arch.empty() ? "(none)" : arch.c_str());
    }
    return false;
}

// The mask token of a file without tokenizer.ggml.mask_token_id (spec 5): the one token of type CONTROL (3) or
// USER_DEFINED (4) whose text contains "mask", case-insensitive; -1 unless there is exactly one.
static int32_t clover_find_mask_token(const gguf_context * gctx) {
    const int64_t tokens_id = gguf_find_key(gctx, "tokenizer.ggml.tokens");
    const int64_t types_id  = gguf_find_key(gctx, "tokenizer.ggml.token_type");
    if (tokens_id < 0 || types_id < 0 || gguf_get_kv_type(gctx, tokens_id) != GGUF_TYPE_ARRAY ||
        gguf_get_kv_type(gctx, types_id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(gctx, tokens_id) != GGUF_TYPE_STRING ||
        gguf_get_arr_type(gctx, types_id) != GGUF_TYPE_INT32) {
        return -1;
    }
    const size_t n = std::min(gguf_get_arr_n(gctx, tokens_id), gguf_get_arr_n(gctx, types_id));
    const int32_t * types = (const int32_t *) gguf_get_arr_data(gctx, types_id);
    int32_t found = -1;
    int32_t n_found = 0;
    for (size_t i = 0; i < n; ++i) {
        if (types[i] != LLAMA_TOKEN_TYPE_CONTROL && types[i] != LLAMA_TOKEN_TYPE_USER_DEFINED) {
            continue;
        }
        std::string text = gguf_get_arr_str(gctx, tokens_id, i);
        std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return (char) std::tolower(c); });
        if (text.find("mask") != std::string::npos) {
            found = (int32_t) i;
            n_found++;
        }
    }
    return n_found == 1 ? found : -1;
}

static std::string clover_gguf_arch(const gguf_context * gctx) {
    const int64_t id = gguf_find_key(gctx, "general.architecture");
    return id >= 0 && gguf_get_kv_type(gctx, id) == GGUF_TYPE_STRING ? gguf_get_val_str(gctx, id) : "";
}

// a clover GGUF's header (no tensor data), checked against the file's size, and its architecture (one of spec v2's
// spellings); nullptr with err set
static gguf_ptr clover_gguf_open(const char * path, std::string & arch, std::string & err) {
    const std::string problem = clover_input_file_problem(path); // a fifo would block gguf's fopen
    if (!problem.empty()) {
        err = clover_format("'%s': %s", path, problem.c_str());
        return nullptr;
    }
    gguf_init_params gparams = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_ptr gctx(gguf_init_from_file(path, gparams));
    if (!gctx) {
        err = clover_gguf_open_error(path);
        return nullptr;
    }
    arch = clover_gguf_arch(gctx.get());
    if (!clover_check_data_size(path, gctx.get(), err) || !clover_check_arch(path, arch, err)) {
        return nullptr;
    }
    return gctx;
}

// A scalar block-diffusion key (clover-keys.h) of the file: false when absent; when present, out is its value,
// or err is set (a wrong type or a value out of the table's range) and false returned with present = true.
static bool clover_gguf_bd_scalar(const gguf_context * gctx, const char * path, const std::string & arch,
                                  clover_bd_key_id id, double & out, bool & present, std::string & err) {
    const std::string key = clover_bd_key_name(id, arch);
    present = gguf_find_key(gctx, key.c_str()) >= 0;
    if (!present) {
        return false;
    }
    int64_t i = 0;
    float f = 0.0f;
    if (clover_bd_key_is_int(id) ? !clover_gguf_int(gctx, key.c_str(), i) : !clover_gguf_float(gctx, key.c_str(), f)) {
        err = clover_format("'%s': %s is not %s", path, key.c_str(), clover_bd_key_is_int(id) ? "an integer" : "a float");
        return false;
    }
    out = clover_bd_key_is_int(id) ? (double) i : (double) f;
    const std::string why = clover_bd_key_check(id, out);
    if (!why.empty()) {
        err = clover_format("'%s': %s = %s %s", path, key.c_str(), clover_bd_num_str(out).c_str(), why.c_str());
        return false;
    }
    return true;
}

// An array block-diffusion key (clover-keys.h) of the file, each element range-checked; false with err set when
// present but not an array of numbers or out of range, false with err empty when absent.
static bool clover_gguf_bd_array(const gguf_context * gctx, const char * path, const std::string & arch,
                                 clover_bd_key_id id, std::vector<double> & out, std::string & err) {
    const std::string key = clover_bd_key_name(id, arch);
    out.clear();
    if (gguf_find_key(gctx, key.c_str()) < 0) {
        return false;
    }
    if (!clover_gguf_num_array(gctx, key.c_str(), out)) {
        err = clover_format("'%s': %s must be an array of numbers", path, key.c_str());
        return false;
    }
    for (double v : out) {
        const std::string why = clover_bd_key_check(id, v);
        if (!why.empty()) {
            err = clover_format("'%s': %s holds %s; each value %s", path, key.c_str(), clover_bd_num_str(v).c_str(),
                    why.c_str());
            return false;
        }
    }
    return true;
}

// The block-diffusion keys (spec v2 section 5, clover-keys.h) of a model file or a sidecar, over the values info
// already holds: an absent key keeps them. The mask token is read only from tokenizer.ggml.mask_token_id (-1 stays
// when absent).
static bool clover_read_bd_keys(const gguf_context * gctx, const char * path, const std::string & arch,
                                clover_model_info & info, std::string & err) {
    struct scalar { clover_bd_key_id id; int32_t * i; float * f; };
    const scalar scalars[] = {
        { CLOVER_BD_KEY_BLOCK_SIZE,    &info.block_size,    nullptr             },
        { CLOVER_BD_KEY_THRESHOLD,     nullptr,             &info.threshold     },
        { CLOVER_BD_KEY_CORESET_TOP_P, nullptr,             &info.coreset_top_p },
        { CLOVER_BD_KEY_HISTORY_ROWS,  &info.history_rows,  nullptr             },
        { CLOVER_BD_KEY_MASK_TOKEN_ID, &info.mask_token_id, nullptr             },
    };
    for (const scalar & s : scalars) {
        double v = 0.0;
        bool present = false;
        if (clover_gguf_bd_scalar(gctx, path, arch, s.id, v, present, err)) {
            if (s.i) {
                *s.i = (int32_t) v;
            } else {
                *s.f = (float) v;
            }
        } else if (present) {
            return false;
        }
    }
    {
        const int64_t id = gguf_find_key(gctx, clover_bd_key_name(CLOVER_BD_KEY_SHIFT_LOGITS, arch).c_str());
        if (id >= 0 && gguf_get_kv_type(gctx, id) == GGUF_TYPE_BOOL && !gguf_get_val_bool(gctx, id)) {
            err = clover_format("'%s': diffusion.shift_logits = false: unshifted block diffusion is not implemented", path);
            return false;
        }
    }

    std::vector<double> sizes;
    std::vector<double> thresholds;
    const bool has_sizes      = clover_gguf_bd_array(gctx, path, arch, CLOVER_BD_KEY_CALIBRATED_BLOCK_SIZES, sizes, err);
    if (!has_sizes && !err.empty()) {
        return false;
    }
    const bool has_thresholds = clover_gguf_bd_array(gctx, path, arch, CLOVER_BD_KEY_CALIBRATED_THRESHOLDS, thresholds, err);
    if (!has_thresholds && !err.empty()) {
        return false;
    }
    if (has_sizes != has_thresholds || sizes.size() != thresholds.size()) {
        err = clover_format("'%s': %s and %s differ in length", path,
                clover_bd_key_name(CLOVER_BD_KEY_CALIBRATED_BLOCK_SIZES, arch).c_str(),
                clover_bd_key_name(CLOVER_BD_KEY_CALIBRATED_THRESHOLDS, arch).c_str());
        return false;
    }
    if (sizes.size() > CLOVER_MAX_CALIBRATED) {
        err = clover_format("'%s': %zu calibrated block sizes, at most %d are supported", path, sizes.size(), CLOVER_MAX_CALIBRATED);
        return false;
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
        info.calibrated_block_sizes[i] = (int32_t) sizes[i];
        info.calibrated_thresholds[i]  = (float) thresholds[i];
    }
    info.n_calibrated = (int32_t) sizes.size();
    return true;
}

// whether the file holds block-diffusion tensors (the loader refuses a file with only some of them)
static bool clover_has_bd_tensors(const gguf_context * gctx) {
    for (int64_t i = 0; i < gguf_get_n_tensors(gctx); ++i) {
        const char * name = gguf_get_tensor_name(gctx, i);
        const char * tail = std::strstr(name, ".bd_conv_right.weight");
        if (std::strncmp(name, "blk.", 4) == 0 && tail != nullptr && std::strcmp(tail, ".bd_conv_right.weight") == 0) {
            return true;
        }
    }
    return false;
}

// The trunk fingerprint of spec v2 section 5, from a trunk's header, with llama.cpp's qwen35moe rules: the recurrent
// layers from attention.recurrent_layers, else every layer but each full_attention_interval-th. The converter
// computes the same string from the checkpoint (clover_convert.sidecar). Empty when a field is missing.
static std::string clover_trunk_fingerprint(const gguf_context * gctx, const std::string & arch) {
    const auto key = [&](const char * suffix) { return arch + "." + suffix; };
    int64_t n_layer = 0, nk = 0, nv = 0, dk = 0, d_inner = 0, kc = 0;
    if (!clover_gguf_int(gctx, key("block_count").c_str(), n_layer) || n_layer < 1 ||
        !clover_gguf_int(gctx, key("ssm.group_count").c_str(), nk) ||
        !clover_gguf_int(gctx, key("ssm.time_step_rank").c_str(), nv) || nv < 1 ||
        !clover_gguf_int(gctx, key("ssm.state_size").c_str(), dk) ||
        !clover_gguf_int(gctx, key("ssm.inner_size").c_str(), d_inner) ||
        !clover_gguf_int(gctx, key("ssm.conv_kernel").c_str(), kc)) {
        return "";
    }
    std::vector<bool> recurrent(n_layer);
    const int64_t rid = gguf_find_key(gctx, key("attention.recurrent_layers").c_str());
    if (rid >= 0 && gguf_get_kv_type(gctx, rid) == GGUF_TYPE_ARRAY && gguf_get_arr_type(gctx, rid) == GGUF_TYPE_BOOL &&
        (int64_t) gguf_get_arr_n(gctx, rid) == n_layer) {
        const int8_t * flags = (const int8_t *) gguf_get_arr_data(gctx, rid);
        for (int64_t i = 0; i < n_layer; ++i) {
            recurrent[i] = flags[i] != 0;
        }
    } else {
        int64_t interval = 4;
        clover_gguf_int(gctx, key("full_attention_interval").c_str(), interval);
        for (int64_t i = 0; i < n_layer; ++i) {
            recurrent[i] = interval > 0 && (i + 1) % interval != 0;
        }
    }
    const int64_t tid = gguf_find_key(gctx, "tokenizer.ggml.tokens");
    if (tid < 0 || gguf_get_kv_type(gctx, tid) != GGUF_TYPE_ARRAY || gguf_get_arr_type(gctx, tid) != GGUF_TYPE_STRING) {
        return "";
    }
    const size_t n_vocab = gguf_get_arr_n(gctx, tid);
    std::string joined;
    for (size_t i = 0; i < n_vocab; ++i) {
        if (i > 0) {
            joined.push_back('\0');
        }
        joined += gguf_get_arr_str(gctx, tid, i);
    }
    std::string gdn;
    for (int64_t i = 0; i < n_layer; ++i) {
        if (recurrent[i]) {
            gdn += (gdn.empty() ? "" : ",") + std::to_string(i);
        }
    }
    return clover_format("L=%lld;gdn=%s;nk=%lld;nv=%lld;dk=%lld;dv=%lld;kc=%lld;vocab=%zu;tok=%s", (long long) n_layer,
            gdn.c_str(), (long long) nk, (long long) nv, (long long) dk, (long long) (d_inner / nv), (long long) kc,
            n_vocab, hash_sha256_hex(joined.data(), joined.size()).c_str());
}

// the names of the fingerprint fields in which a and b differ, comma-separated
static std::string clover_fingerprint_diff(const std::string & a, const std::string & b) {
    const auto fields = [](const std::string & s) {
        std::vector<std::pair<std::string, std::string>> out;
        size_t start = 0;
        while (start <= s.size()) {
            const size_t end = std::min(s.find(';', start), s.size());
            const std::string part = s.substr(start, end - start);
            const size_t eq = part.find('=');
            out.emplace_back(part.substr(0, eq), eq == std::string::npos ? "" : part.substr(eq + 1));
            start = end + 1;
        }
        return out;
    };
    static const char * const names[] = { "L", "gdn", "nk", "nv", "dk", "dv", "kc", "vocab", "tok" };
    const auto fa = fields(a);
    const auto fb = fields(b);
    const auto value = [](const std::vector<std::pair<std::string, std::string>> & f, const char * name) {
        for (const auto & kv : f) {
            if (kv.first == name) {
                return kv.second;
            }
        }
        return std::string("\x01");  // missing: differs from any value
    };
    std::string out;
    for (const char * name : names) {
        if (value(fa, name) != value(fb, name)) {
            out += (out.empty() ? "" : ", ") + std::string(name);
        }
    }
    return out;
}

// A sidecar for the trunk gctx (path): its architecture family, its fingerprint against the trunk's, then its keys
// over info (spec 5: a trunk and a sidecar match by architecture family and fingerprint, not by spelling).
static bool clover_read_sidecar(const gguf_context * trunk, const char * path, const std::string & trunk_arch,
                                const char * bd_path, clover_model_info & info, std::string & err) {
    std::string arch;
    gguf_ptr side = clover_gguf_open(bd_path, arch, err);  // what the sidecar's path is comes first
    if (!side) {
        return false;
    }
    if (clover_has_bd_tensors(trunk)) {
        err = clover_format("'%s' already holds the block-diffusion tensors: a sidecar (%s) goes with a trunk-only file",
                path, bd_path);
        return false;
    }
    const std::string fp_key = arch + ".bd.trunk_fingerprint";
    const int64_t fid = gguf_find_key(side.get(), fp_key.c_str());
    if (fid < 0 || gguf_get_kv_type(side.get(), fid) != GGUF_TYPE_STRING) {
        err = clover_format("'%s': %s is missing: not a block-diffusion sidecar (make one with clover-convert --bd-only)",
                bd_path, fp_key.c_str());
        return false;
    }
    const std::string want = gguf_get_val_str(side.get(), fid);
    const std::string have = clover_trunk_fingerprint(trunk, trunk_arch);
    if (have.empty()) {
        err = clover_format("'%s': the trunk's fingerprint cannot be computed (block_count, ssm.* or the token list is "
                "missing)", path);
        return false;
    }
    if (want != have) {
        err = clover_format("'%s' is the sidecar of another trunk: fingerprint fields %s differ from '%s' (%s: %s; trunk: %s)", bd_path,
                clover_fingerprint_diff(want, have).c_str(), path, fp_key.c_str(), want.c_str(), have.c_str());
        return false;
    }
    if (!clover_has_bd_tensors(side.get())) {
        err = clover_format("'%s' holds no block-diffusion tensors (blk.N.bd_conv_right.weight, ...)", bd_path);
        return false;
    }
    const int32_t trunk_mask = info.mask_token_id;
    info.mask_token_id = -1;
    if (!clover_read_bd_keys(side.get(), bd_path, arch, info, err)) {
        return false;
    }
    if (info.mask_token_id < 0) {
        info.mask_token_id = trunk_mask;
    }
    info.has_block_diffusion = 1;
    return true;
}

// The default penalties (spec 4): llama.cpp's general.sampling.penalty_repeat, _penalty_present and _penalty_freq
// (what common_sampler reads too); a file converted before those keys has ARCH.sampling.presence_penalty and
// ARCH.sampling.frequency_penalty. An absent key is off.
static bool clover_read_penalties(const gguf_context * gctx, const char * path, const std::string & arch,
                                  clover_model_info & info, std::string & err) {
    struct key_value { std::string key; std::string older; float * out; bool positive; };
    info.repeat_penalty    = 1.0f;
    info.presence_penalty  = 0.0f;
    info.frequency_penalty = 0.0f;
    const key_value keys[] = {
        { "general.sampling.penalty_repeat",  "",                                  &info.repeat_penalty,    true  },
        { "general.sampling.penalty_present", arch + ".sampling.presence_penalty",  &info.presence_penalty,  false },
        { "general.sampling.penalty_freq",    arch + ".sampling.frequency_penalty", &info.frequency_penalty, false },
    };
    for (const auto & kv : keys) {
        const std::string & key = gguf_find_key(gctx, kv.key.c_str()) >= 0 ? kv.key : kv.older;
        if (key.empty() || gguf_find_key(gctx, key.c_str()) < 0) {
            continue;
        }
        if (!clover_gguf_float(gctx, key.c_str(), *kv.out) || !std::isfinite(*kv.out) ||
            (kv.positive && !(*kv.out > 0.0f))) {
            err = clover_format("'%s': %s must be a finite float%s", path, key.c_str(), kv.positive ? " > 0" : "");
            return false;
        }
    }
    return true;
}

// A BPE vocabulary (tokenizer.ggml.model "gpt2") names its pre-tokenizer: without tokenizer.ggml.pre llama.cpp splits
// text with its default one (a warning) and every prompt becomes other tokens than the model was trained on.
static bool clover_check_pre_tokenizer(const gguf_context * gctx, const char * path, std::string & err) {
    const int64_t model_id = gguf_find_key(gctx, "tokenizer.ggml.model");
    if (model_id < 0 || gguf_get_kv_type(gctx, model_id) != GGUF_TYPE_STRING ||
        std::string(gguf_get_val_str(gctx, model_id)) != "gpt2" || gguf_find_key(gctx, "tokenizer.ggml.pre") >= 0) {
        return true;
    }
    err = clover_format("'%s': missing tokenizer.ggml.pre, which a BPE (\"gpt2\") vocabulary needs: llama.cpp would "
                        "split text with its default pre-tokenizer, not the model's", path);
    return false;
}

bool clover_read_info(const char * path, const char * bd_path, clover_model_info & info, std::string & err) {
    info = {};
    if (!path) {
        err = "no model path given";
        return false;
    }
    std::string arch;
    gguf_ptr gctx = clover_gguf_open(path, arch, err);
    if (!gctx) {
        return false;
    }
    // the block-diffusion keys are optional (llama.cpp's converter writes none): spec 2.2's defaults
    info.block_size    = 32;
    info.threshold     = 0.95f;
    info.coreset_top_p = 1.0f;
    info.history_rows  = 32;
    info.mask_token_id = -1;
    if (!clover_check_pre_tokenizer(gctx.get(), path, err) || !clover_read_bd_keys(gctx.get(), path, arch, info, err) ||
        !clover_read_penalties(gctx.get(), path, arch, info, err)) {
        return false;
    }
    {
        const int64_t id = gguf_find_key(gctx.get(), "tokenizer.ggml.tokens");
        info.n_vocab = id >= 0 && gguf_get_kv_type(gctx.get(), id) == GGUF_TYPE_ARRAY ? (int32_t) gguf_get_arr_n(gctx.get(), id) : 0;
    }
    int64_t v = 0;
    info.n_ctx_train = clover_gguf_int(gctx.get(), (arch + ".context_length").c_str(), v) ? (int32_t) v : 0;
    info.has_block_diffusion = clover_has_bd_tensors(gctx.get()) ? 1 : 0;
    if (bd_path != nullptr && bd_path[0] != '\0' && !clover_read_sidecar(gctx.get(), path, arch, bd_path, info, err)) {
        return false;
    }
    if (info.mask_token_id < 0) {
        info.mask_token_id = clover_find_mask_token(gctx.get());
    }
    // K_r = ssm.conv_kernel - 1 (the loader checks the tensors against it)
    info.conv_right_kernel = 0;
    if (info.has_block_diffusion && clover_gguf_int(gctx.get(), (arch + ".ssm.conv_kernel").c_str(), v) && v > 1) {
        info.conv_right_kernel = (int32_t) (v - 1);
    }
    return true;
}

int32_t clover_gguf_n_layer(const char * path, std::string & err) {
    std::string arch;
    gguf_ptr gctx = clover_gguf_open(path, arch, err);  // the keys are read under the file's own spelling
    int64_t n = -1;
    if (!gctx) {
        return -1;
    }
    const std::string key = arch + ".block_count";
    if (!clover_gguf_int(gctx.get(), key.c_str(), n)) {  // absent, or not an integer
        err = gguf_find_key(gctx.get(), key.c_str()) < 0 ? clover_format("'%s': missing %s", path, key.c_str())
            : clover_format("'%s': %s is not an integer", path, key.c_str());
        return -1;
    }
    if (n < 0 || n > INT32_MAX) {  // present but out of range (llama.cpp's loader allows 1 .. LLAMA_MAX_LAYERS)
        err = clover_format("'%s': %s = %lld is out of range for a layer count", path, key.c_str(), (long long) n);
        return -1;
    }
    return (int32_t) n;
}
