// Clover importance-matrix collector: squared activations that enter every weight matmul, in llama.cpp's
// imatrix GGUF format (the format of tools/imatrix, read back by llama-quantize --imatrix).
//
// Set clover_imatrix_eval_cb as llama_context_params.cb_eval with cb_eval_user_data = the collector, then
// decode as usual (causal and block passes alike). The collector only reads the inputs of GGML_OP_MUL_MAT
// and GGML_OP_MUL_MAT_ID nodes whose weight is a `blk.*.weight` tensor (output.weight is skipped, as the
// stock tool does by default); it never changes a result. Inputs that live in a non-host buffer (CUDA) are
// copied with ggml_backend_tensor_get.
//
// Per weight it keeps the sum over token rows of x*x per input column, and the number of rows: one count
// per dense weight, one sum and one count per expert for MUL_MAT_ID (routed experts). Nothing is dropped:
// unlike the stock tool, small batches (< 16 rows: block windows) are collected too.

#pragma once

#include "clover.h"  // CLOVER_API

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_tensor;
struct clover_imatrix;

// A new collector, owned by the caller (free it with clover_imatrix_free), or NULL when out of memory.
CLOVER_API struct clover_imatrix * clover_imatrix_init(void);
CLOVER_API void                    clover_imatrix_free(struct clover_imatrix * im);

// ggml_backend_sched_eval_callback; user_data is the collector. Always returns true when ask is false,
// so the scheduler never stops a graph because of the collector (errors are kept, see last_error).
CLOVER_API bool clover_imatrix_eval_cb(struct ggml_tensor * t, bool ask, void * user_data);

// Counts one finished chunk (written as imatrix.chunk_count).
CLOVER_API void    clover_imatrix_end_chunk(struct clover_imatrix * im);
CLOVER_API int32_t clover_imatrix_n_chunks(const struct clover_imatrix * im);

// Number of weights seen so far (each becomes an in_sum2/counts tensor pair).
CLOVER_API int32_t clover_imatrix_n_entries(const struct clover_imatrix * im);

// Number of matmul inputs collected so far (callback calls with ask == false that were used).
CLOVER_API int64_t clover_imatrix_n_calls(const struct clover_imatrix * im);

// The first collection error (inconsistent sizes, non-finite values, an unsupported input type), or NULL.
// After an error the collector stops collecting and refuses to save. Owned by the collector: valid until
// clover_imatrix_free.
CLOVER_API const char * clover_imatrix_last_error(const struct clover_imatrix * im);

// Writes `<name>.in_sum2` [n_cols, n_mat] and `<name>.counts` [1, n_mat] (F32) per weight, sorted by name,
// with general.type = "imatrix", imatrix.datasets = [dataset], imatrix.chunk_count and imatrix.chunk_size.
// The file is written to path + ".tmp" and renamed over path. Returns 0, or -1 with a message in err.
CLOVER_API int32_t clover_imatrix_save(
        const struct clover_imatrix * im,
        const char                  * path,
        const char                  * dataset,
        int32_t                       chunk_size,
        char                        * err,
        size_t                        err_size);

#ifdef __cplusplus
}
#endif
