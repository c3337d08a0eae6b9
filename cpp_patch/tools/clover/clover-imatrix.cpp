// Clover importance-matrix collector (see clover-imatrix.h). The collection follows llama.cpp's
// tools/imatrix/imatrix.cpp (IMatrixCollector::collect_imatrix and save_imatrix) so that llama-quantize
// reads the result exactly as it reads the stock tool's file.

#include "clover-imatrix.h"
#include "clover-log.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <vector>

struct clover_imatrix_entry {
    std::vector<double>  sums;    // [n_mat][n_cols]: sum of x*x per input column (double: long runs stay exact)
    std::vector<int64_t> counts;  // [n_mat] (dense weights: 1): token rows seen
};

struct clover_imatrix {
    std::mutex mutex;

    std::map<std::string, clover_imatrix_entry> entries;  // ordered: the file is written sorted by name

    int32_t n_chunks = 0;
    int64_t n_calls  = 0;

    std::string       error;
    std::atomic<bool> failed{false};  // error is set (read without the lock by the ask calls)

    std::vector<char> src1_data;  // host copy of a non-host input
    std::vector<char> ids_data;   // host copy of the expert ids of a MUL_MAT_ID
};

// "CUDA0#blk.0.attn_k.weight#0" (a scheduler copy) -> "blk.0.attn_k.weight"
static std::string clover_imatrix_weight_name(const char * name) {
    const char * p = strchr(name, '#');
    if (p == nullptr) {
        return name;
    }
    p = p + 1;
    const char * q = strchr(p, '#');
    return q ? std::string(p, q - p) : std::string(p);
}

// A weight of a layer: `blk.*.weight`. Views and reshapes of a weight (`... (reshaped)`) and activations
// (`kq-3`, cache views) do not match; output.weight is skipped as by the stock tool.
static bool clover_imatrix_wanted(const std::string & wname) {
    static const std::string prefix = "blk.";
    static const std::string suffix = ".weight";
    return wname.size() > prefix.size() + suffix.size() &&
           wname.compare(0, prefix.size(), prefix) == 0 &&
           wname.compare(wname.size() - suffix.size(), suffix.size(), suffix) == 0;
}

static void clover_imatrix_fail(clover_imatrix * im, const std::string & msg) {
    if (im->error.empty()) {
        im->error = msg;
        im->failed.store(true);
        clover_log(GGML_LOG_LEVEL_ERROR, "clover_imatrix: error: %s\n", msg.c_str());
    }
}

static const char * clover_imatrix_host_data(std::vector<char> & buf, const ggml_tensor * t) {
    if (t->buffer == nullptr || ggml_backend_buffer_is_host(t->buffer)) {
        return (const char *) t->data;
    }
    const size_t n = ggml_nbytes(t);
    buf.resize(n);
    ggml_backend_tensor_get(t, buf.data(), 0, n);
    return buf.data();
}

static bool clover_imatrix_finite(const double * v, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(v[i])) {
            return false;
        }
    }
    return true;
}

// routed experts: ids [n_expert_used, n_tokens], src1 [n_cols, n_expert_used or 1, n_tokens]
static void clover_imatrix_collect_id(clover_imatrix * im, const ggml_tensor * t, const std::string & wname,
        const char * data) {
    const ggml_tensor * src0 = t->src[0];
    const ggml_tensor * src1 = t->src[1];
    const ggml_tensor * ids  = t->src[2];

    const int64_t n_as     = src0->ne[2];
    const int64_t n_ids    = ids->ne[0];
    const int64_t ne0      = src1->ne[0];
    const int64_t n_tokens = src1->ne[2];

    if (ids->ne[1] != n_tokens || ggml_nrows(src1) != src1->ne[1] * src1->ne[2] || ids->type != GGML_TYPE_I32) {
        clover_imatrix_fail(im, clover_format("%s: unsupported MUL_MAT_ID layout", wname.c_str()));
        return;
    }

    const char * ids_data = clover_imatrix_host_data(im->ids_data, ids);

    auto & e = im->entries[wname];
    if (e.sums.empty()) {
        e.sums.assign(ne0 * n_as, 0.0);
        e.counts.assign(n_as, 0);
    } else if (e.sums.size() != (size_t) (ne0 * n_as) || e.counts.size() != (size_t) n_as) {
        clover_imatrix_fail(im, clover_format("%s: inconsistent size (%zu x %zu, now %lld x %lld)",
                wname.c_str(), e.sums.size() / std::max<size_t>(1, e.counts.size()), e.counts.size(),
                (long long) ne0, (long long) n_as));
        return;
    }

    std::vector<uint8_t> touched(n_as, 0);
    for (int64_t idx = 0; idx < n_ids; ++idx) {
        for (int64_t row = 0; row < n_tokens; ++row) {
            const int32_t ex = *(const int32_t *) (ids_data + row * ids->nb[1] + idx * ids->nb[0]);
            if (ex < 0 || ex >= n_as) {
                clover_imatrix_fail(im, clover_format("%s: expert id %d out of range", wname.c_str(), ex));
                return;
            }
            const int64_t i11 = idx % src1->ne[1];
            const float * x   = (const float *) (data + i11 * src1->nb[1] + row * src1->nb[2]);
            double      * acc = e.sums.data() + ex * ne0;
            for (int64_t j = 0; j < ne0; ++j) {
                acc[j] += (double) x[j] * (double) x[j];
            }
            e.counts[ex]++;
            touched[ex] = 1;
        }
    }
    for (int64_t ex = 0; ex < n_as; ++ex) {
        if (touched[ex] && !clover_imatrix_finite(e.sums.data() + ex * ne0, ne0)) {
            clover_imatrix_fail(im, clover_format("%s: non-finite activations", wname.c_str()));
            return;
        }
    }
}

// dense weights: one count; a 3-D+ weight keeps one sum row per matrix, activations broadcast over it
static void clover_imatrix_collect_dense(clover_imatrix * im, const ggml_tensor * t, const std::string & wname,
        const char * data) {
    const ggml_tensor * src0 = t->src[0];
    const ggml_tensor * src1 = t->src[1];

    const int64_t n_mat = src0->ne[2] * src0->ne[3];
    const int64_t ne0   = src1->ne[0];

    auto & e = im->entries[wname];
    if (e.sums.empty()) {
        e.sums.assign(ne0 * n_mat, 0.0);
        e.counts.assign(1, 0);
    } else if (e.sums.size() != (size_t) (ne0 * n_mat) || e.counts.size() != 1) {
        clover_imatrix_fail(im, clover_format("%s: inconsistent size (%zu values, now %lld)",
                wname.c_str(), e.sums.size(), (long long) (ne0 * n_mat)));
        return;
    }

    for (int64_t i3 = 0; i3 < src1->ne[3]; ++i3) {
        for (int64_t i2 = 0; i2 < src1->ne[2]; ++i2) {
            const int64_t mat_id = (i3 % src0->ne[3]) * src0->ne[2] + (i2 % src0->ne[2]);
            double      * acc    = e.sums.data() + mat_id * ne0;
            for (int64_t row = 0; row < src1->ne[1]; ++row) {
                const float * x = (const float *) (data + row * src1->nb[1] + i2 * src1->nb[2] + i3 * src1->nb[3]);
                for (int64_t j = 0; j < ne0; ++j) {
                    acc[j] += (double) x[j] * (double) x[j];
                }
            }
        }
    }
    e.counts[0] += ggml_nrows(src1) / n_mat;

    if (!clover_imatrix_finite(e.sums.data(), e.sums.size())) {
        clover_imatrix_fail(im, clover_format("%s: non-finite activations", wname.c_str()));
    }
}

extern "C" {

struct clover_imatrix * clover_imatrix_init(void) {
    return new (std::nothrow) clover_imatrix();
}

void clover_imatrix_free(struct clover_imatrix * im) {
    delete im;
}

bool clover_imatrix_eval_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * im = (clover_imatrix *) user_data;
    if (im == nullptr || t == nullptr) {
        return !ask;
    }
    if (t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_MUL_MAT_ID) {
        return !ask;  // ask: not interested; otherwise: never stop the graph
    }
    const ggml_tensor * src0 = t->src[0];
    const ggml_tensor * src1 = t->src[1];
    if (src0 == nullptr || src1 == nullptr) {
        return !ask;
    }
    const std::string wname = clover_imatrix_weight_name(src0->name);

    if (ask) {
        return !im->failed.load() && clover_imatrix_wanted(wname);
    }

    std::lock_guard<std::mutex> lock(im->mutex);
    if (!im->error.empty() || !clover_imatrix_wanted(wname)) {
        return true;
    }
    if (src1->type != GGML_TYPE_F32 || src1->nb[0] != ggml_element_size(src1)) {
        clover_imatrix_fail(im, clover_format("%s: input of type %s (or not row-contiguous); "
                "only F32 is supported", wname.c_str(), ggml_type_name(src1->type)));
        return true;
    }

    const char * data = clover_imatrix_host_data(im->src1_data, src1);
    if (t->op == GGML_OP_MUL_MAT_ID) {
        clover_imatrix_collect_id(im, t, wname, data);
    } else {
        clover_imatrix_collect_dense(im, t, wname, data);
    }
    im->n_calls++;
    return true;
}

void clover_imatrix_end_chunk(struct clover_imatrix * im) {
    std::lock_guard<std::mutex> lock(im->mutex);
    im->n_chunks++;
}

int32_t clover_imatrix_n_chunks(const struct clover_imatrix * im) {
    return im->n_chunks;
}

int32_t clover_imatrix_n_entries(const struct clover_imatrix * im) {
    return (int32_t) im->entries.size();
}

int64_t clover_imatrix_n_calls(const struct clover_imatrix * im) {
    return im->n_calls;
}

const char * clover_imatrix_last_error(const struct clover_imatrix * im) {
    return im->error.empty() ? nullptr : im->error.c_str();
}

int32_t clover_imatrix_save(
        const struct clover_imatrix * im,
        const char                  * path,
        const char                  * dataset,
        int32_t                       chunk_size,
        char                        * err,
        size_t                        err_size) {
    auto set_err = [&](const std::string & msg) {
        clover_set_err(err, err_size, msg);
        return -1;
    };
    if (im == nullptr || path == nullptr || path[0] == '\0') {
        return set_err("no collector or no output path");
    }
    if (!im->error.empty()) {
        return set_err("collection failed: " + im->error);
    }
    if (im->entries.empty()) {
        return set_err("no activations were collected");
    }
    if (chunk_size <= 0) {
        return set_err(clover_format("chunk size must be positive, got %d", chunk_size));
    }

    size_t data_size = 0;
    for (const auto & kv : im->entries) {
        data_size += GGML_PAD(ggml_tensor_overhead() + sizeof(float) * kv.second.sums.size(), GGML_MEM_ALIGN);
        data_size += GGML_PAD(ggml_tensor_overhead() + sizeof(float) * kv.second.counts.size(), GGML_MEM_ALIGN);
    }
    struct ggml_init_params params = {
        /* .mem_size   = */ data_size,
        /* .mem_buffer = */ nullptr,
        /* .no_alloc   = */ false,
    };
    struct ggml_context * ctx = ggml_init(params);
    if (ctx == nullptr) {
        return set_err("out of memory");
    }
    struct gguf_context * gctx = gguf_init_empty();

    gguf_set_val_str(gctx, "general.type", "imatrix");
    const char * datasets[1] = { dataset ? dataset : "" };
    gguf_set_arr_str(gctx, "imatrix.datasets", datasets, dataset ? 1 : 0);
    gguf_set_val_u32(gctx, "imatrix.chunk_count", (uint32_t) im->n_chunks);
    gguf_set_val_u32(gctx, "imatrix.chunk_size", (uint32_t) chunk_size);

    for (const auto & kv : im->entries) {
        const auto &  e     = kv.second;
        const int64_t n_mat = (int64_t) e.counts.size();
        const int64_t n_val = (int64_t) e.sums.size();
        if (n_mat == 0 || n_val == 0) {
            continue;
        }
        struct ggml_tensor * in_sum2 = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_val / n_mat, n_mat);
        struct ggml_tensor * counts  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, n_mat);
        ggml_format_name(in_sum2, "%s.in_sum2", kv.first.c_str());
        ggml_format_name(counts,  "%s.counts",  kv.first.c_str());
        for (int64_t j = 0; j < n_val; ++j) {
            ((float *) in_sum2->data)[j] = (float) e.sums[j];
        }
        for (int64_t j = 0; j < n_mat; ++j) {
            ((float *) counts->data)[j] = (float) e.counts[j];
        }
        gguf_add_tensor(gctx, in_sum2);
        gguf_add_tensor(gctx, counts);
    }

    const std::string tmp = std::string(path) + ".tmp";
    const bool written = gguf_write_to_file(gctx, tmp.c_str(), false);
    gguf_free(gctx);
    ggml_free(ctx);
    if (!written) {
        std::remove(tmp.c_str());
        return set_err("cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), path) != 0) {
        const std::string why = strerror(errno);
        std::remove(tmp.c_str());
        return set_err(std::string("cannot rename ") + tmp + " to " + path + ": " + why);
    }
    return 0;
}

}  // extern "C"
