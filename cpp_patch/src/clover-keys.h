// The block-diffusion keys of a clover GGUF (spec v2 section 5): one table for both readers, the model's loader
// (src/models/clover.cpp, load_bd_hparams) and the engine's header reader (tools/clover/clover-gguf.cpp,
// clover_read_bd_keys). The writer mirrors it in Python (clover_convert/model_keys.py BD_KEYS;
// tests/convert/test_bd_keys_table.py compares the two by parsing this file, so keep one X(...) per line).
//
// X(ID, KV, SCOPE, SUFFIX, TYPE, DEFAULT, LO, HI, LO_OPEN)
//   KV     the llm_kv id of the key in the patched llama-arch (expanded only by the loader, which checks at load that
//          llama-arch's name of it is SUFFIX's)
//   SCOPE  ARCH: the key is "<general.architecture>.<SUFFIX>"; GLOBAL: the key is SUFFIX itself
//   TYPE   the GGUF type the converter writes: U32, F32, BOOL, or ARR_U32 / ARR_F32 (LO .. HI bound each element)
//   DEFAULT what an absent key means (spec 2.2); NAN where it is derived: the readout scale is 1/sqrt(ssm.state_size),
//          the mask token the one vocabulary token whose text contains "mask", the calibrated lists empty
//   LO, HI the valid range, inclusive (LO exclusive when LO_OPEN is 1); for floats, NaN and infinities are refused
//          too. The block sizes' 256 is the converter's clover_common/config.py MAX_BLOCK_SIZE: every block size
//          needs B-1 rollback states of the recurrent memory
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#define CLOVER_BD_KEYS(X) \
    X(BLOCK_SIZE,             LLM_KV_DFLASH_BLOCK_SIZE,             ARCH,   "block_size",                       U32,     32,   1,       256,        0) \
    X(THRESHOLD,              LLM_KV_CLOVER_DIFFUSION_THRESHOLD,    ARCH,   "diffusion.threshold",              F32,     0.95, 0,       1,          0) \
    X(CORESET_TOP_P,          LLM_KV_CLOVER_CORESET_TOP_P,          ARCH,   "diffusion.coreset_top_p",          F32,     1,    0,       1,          1) \
    X(HISTORY_ROWS,           LLM_KV_CLOVER_HISTORY_ROWS,           ARCH,   "diffusion.history_rows",           U32,     32,   1,       2147483647, 0) \
    X(HISTORY_READOUT_SCALE,  LLM_KV_CLOVER_HISTORY_READOUT_SCALE,  ARCH,   "bd.history_readout_scale",         F32,     NAN,  -3.4e38, 3.4e38,     0) \
    X(CALIBRATED_BLOCK_SIZES, LLM_KV_CLOVER_CALIBRATED_BLOCK_SIZES, ARCH,   "diffusion.calibrated_block_sizes", ARR_U32, NAN,  1,       256,        0) \
    X(CALIBRATED_THRESHOLDS,  LLM_KV_CLOVER_CALIBRATED_THRESHOLDS,  ARCH,   "diffusion.calibrated_thresholds",  ARR_F32, NAN,  0,       1,          0) \
    X(MASK_TOKEN_ID,          LLM_KV_TOKENIZER_MASK_ID,             GLOBAL, "tokenizer.ggml.mask_token_id",     U32,     NAN,  0,       2147483647, 0) \
    X(SHIFT_LOGITS,           LLM_KV_CLOVER_SHIFT_LOGITS,           GLOBAL, "diffusion.shift_logits",           BOOL,    1,    1,       1,          0)

enum clover_bd_key_id {
#define CLOVER_BD_KEY_ENUM(ID, KV, SCOPE, SUFFIX, TYPE, DEF, LO, HI, LO_OPEN) CLOVER_BD_KEY_##ID,
    CLOVER_BD_KEYS(CLOVER_BD_KEY_ENUM)
#undef CLOVER_BD_KEY_ENUM
    CLOVER_BD_KEY_COUNT,
};

enum clover_bd_key_scope { CLOVER_BD_SCOPE_ARCH, CLOVER_BD_SCOPE_GLOBAL };
enum clover_bd_key_type  { CLOVER_BD_TYPE_U32, CLOVER_BD_TYPE_F32, CLOVER_BD_TYPE_BOOL, CLOVER_BD_TYPE_ARR_U32,
                           CLOVER_BD_TYPE_ARR_F32 };

struct clover_bd_key_spec {
    clover_bd_key_scope scope;
    const char *        suffix;
    clover_bd_key_type  type;
    double              def;      // NAN: derived (see above)
    double              lo;
    double              hi;
    bool                lo_open;
};

static const clover_bd_key_spec CLOVER_BD_KEY_SPECS[CLOVER_BD_KEY_COUNT] = {
#define CLOVER_BD_KEY_SPEC(ID, KV, SCOPE, SUFFIX, TYPE, DEF, LO, HI, LO_OPEN) \
    { CLOVER_BD_SCOPE_##SCOPE, SUFFIX, CLOVER_BD_TYPE_##TYPE, (double) (DEF), (double) (LO), (double) (HI), (LO_OPEN) != 0 },
    CLOVER_BD_KEYS(CLOVER_BD_KEY_SPEC)
#undef CLOVER_BD_KEY_SPEC
};

static inline const clover_bd_key_spec & clover_bd_key(clover_bd_key_id id) {
    return CLOVER_BD_KEY_SPECS[id];
}

// the key's full name in a file of architecture arch
static inline std::string clover_bd_key_name(clover_bd_key_id id, const std::string & arch) {
    const clover_bd_key_spec & spec = clover_bd_key(id);
    return spec.scope == CLOVER_BD_SCOPE_ARCH ? arch + "." + spec.suffix : std::string(spec.suffix);
}

static inline bool clover_bd_key_is_int(clover_bd_key_id id) {
    const clover_bd_key_type t = clover_bd_key(id).type;
    return t == CLOVER_BD_TYPE_U32 || t == CLOVER_BD_TYPE_ARR_U32 || t == CLOVER_BD_TYPE_BOOL;
}

static inline std::string clover_bd_num_str(double v) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%g", v);
    return buf;
}

// The one range check of a value (an element, for an array key): empty when valid, else the rule it breaks, as
// "must be in 1 .. 256", "must be in (0, 1]", "must be >= 1", "must be a finite number" or "must be an integer".
static inline std::string clover_bd_key_check(clover_bd_key_id id, double v) {
    const clover_bd_key_spec & spec = clover_bd_key(id);
    const bool is_int = clover_bd_key_is_int(id);
    const bool finite_only = spec.lo <= -3.4e38 && spec.hi >= 3.4e38;
    if (!std::isfinite(v)) {
        return finite_only ? "must be a finite number" : is_int ? "must be an integer" : "must be a finite number in " +
            std::string(spec.lo_open ? "(" : "[") + clover_bd_num_str(spec.lo) + ", " + clover_bd_num_str(spec.hi) + "]";
    }
    if (is_int && v != std::floor(v)) {
        return "must be an integer";
    }
    const bool ok = (spec.lo_open ? v > spec.lo : v >= spec.lo) && v <= spec.hi;
    if (ok) {
        return "";
    }
    if (finite_only) {
        return "must be a finite number";
    }
    if (is_int) {
        return spec.hi >= 2147483647.0 ? "must be >= " + clover_bd_num_str(spec.lo)
                                       : "must be in " + clover_bd_num_str(spec.lo) + " .. " + clover_bd_num_str(spec.hi);
    }
    return std::string("must be in ") + (spec.lo_open ? "(" : "[") + clover_bd_num_str(spec.lo) + ", " +
           clover_bd_num_str(spec.hi) + "]";
}
