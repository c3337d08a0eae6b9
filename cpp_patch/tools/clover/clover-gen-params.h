// The ranges of clover_gen_params' scalar fields: one table for the engine's checks of a call (clover-params.cpp,
// clover-sampling.cpp) and llama-clover's flags. Python mirrors it once, as the bounds of clover_cpp/gen_params.py's
// PARAMS (tests/native/test_gen_params_c_table.py parses this file, compares the rows and runs the check on probes;
// keep one X(...) per line). Not part of the C API.
//
// X(ID, FIELD, LO, HI, LO_OPEN, INTEGER, UNSET, OFF)
//   FIELD    the clover_gen_params field
//   LO, HI   the valid range, inclusive (LO exclusive when LO_OPEN is 1); -INFINITY / INFINITY: no end. A float must
//            be finite whatever its range
//   INTEGER  1 for an integer field (its rule says "must be >= 0" rather than "must be a finite number >= 0")
//   UNSET    the values that stand for the GGUF's value in the C struct (resolved by the engine): NONE (the field has
//            no GGUF value), ZERO (0), NEGATIVE (< 0), NONPOSITIVE (<= 0) or NAN. They lie outside the range
//   OFF      the value that turns the parameter off, for the messages ("" when none does)
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#define CLOVER_GEN_PARAMS(X) \
    X(BLOCK_SIZE,        block_size,        1,         INFINITY, 0, 1, ZERO,        "")        \
    X(THRESHOLD,         threshold,         0,         1,        0, 0, NEGATIVE,    "")        \
    X(CORESET_TOP_P,     coreset_top_p,     0,         1,        1, 0, NONPOSITIVE, "")        \
    X(DRAFT_STEPS,       draft_steps,       0,         INFINITY, 0, 1, NONE,        "")        \
    X(MAX_TOKENS,        max_tokens,        0,         INFINITY, 0, 1, NONE,        "")        \
    X(TEMPERATURE,       temperature,       0,         INFINITY, 0, 0, NONE,        "")        \
    X(TOP_K,             top_k,             0,         INFINITY, 0, 1, NONE,        "0 = off") \
    X(TOP_P,             top_p,             0,         1,        1, 0, NONE,        "1 = off") \
    X(REPEAT_PENALTY,    repeat_penalty,    0,         INFINITY, 1, 0, NAN,         "1 = off") \
    X(PRESENCE_PENALTY,  presence_penalty,  -INFINITY, INFINITY, 0, 0, NAN,         "0 = off") \
    X(FREQUENCY_PENALTY, frequency_penalty, -INFINITY, INFINITY, 0, 0, NAN,         "0 = off")

enum clover_gen_param_id {
#define CLOVER_GEN_PARAM_ENUM(ID, FIELD, LO, HI, LO_OPEN, INTEGER, UNSET, OFF) CLOVER_GEN_PARAM_##ID,
    CLOVER_GEN_PARAMS(CLOVER_GEN_PARAM_ENUM)
#undef CLOVER_GEN_PARAM_ENUM
    CLOVER_GEN_PARAM_COUNT,
};

enum clover_gen_param_unset { CLOVER_UNSET_NONE, CLOVER_UNSET_ZERO, CLOVER_UNSET_NEGATIVE, CLOVER_UNSET_NONPOSITIVE,
                              CLOVER_UNSET_NAN };

struct clover_gen_param_spec {
    const char *          field;
    double                lo;
    double                hi;
    bool                  lo_open;
    bool                  integer;
    clover_gen_param_unset unset;
    const char *          off;
};

static const clover_gen_param_spec CLOVER_GEN_PARAM_SPECS[CLOVER_GEN_PARAM_COUNT] = {
#define CLOVER_GEN_PARAM_SPEC(ID, FIELD, LO, HI, LO_OPEN, INTEGER, UNSET, OFF) \
    { #FIELD, (double) (LO), (double) (HI), (LO_OPEN) != 0, (INTEGER) != 0, CLOVER_UNSET_##UNSET, OFF },
    CLOVER_GEN_PARAMS(CLOVER_GEN_PARAM_SPEC)
#undef CLOVER_GEN_PARAM_SPEC
};

static inline const clover_gen_param_spec & clover_gen_param(clover_gen_param_id id) {
    return CLOVER_GEN_PARAM_SPECS[id];
}

// whether v stands for the GGUF's value (UNSET) rather than being a value to check
static inline bool clover_gen_param_is_unset(clover_gen_param_id id, double v) {
    switch (clover_gen_param(id).unset) {
        case CLOVER_UNSET_ZERO:        return v == 0.0;
        case CLOVER_UNSET_NEGATIVE:    return v < 0.0;
        case CLOVER_UNSET_NONPOSITIVE: return v <= 0.0;
        case CLOVER_UNSET_NAN:         return std::isnan(v);
        case CLOVER_UNSET_NONE:        break;
    }
    return false;
}

// what the C struct's unset values are, for the engine's messages
static inline const char * clover_gen_param_unset_text(clover_gen_param_id id) {
    switch (clover_gen_param(id).unset) {
        case CLOVER_UNSET_ZERO:        return "0";
        case CLOVER_UNSET_NEGATIVE:    return "negative";
        case CLOVER_UNSET_NONPOSITIVE: return "<= 0";
        case CLOVER_UNSET_NAN:         return "NaN";
        case CLOVER_UNSET_NONE:        break;
    }
    return "";
}

static inline std::string clover_gen_num_str(double v) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%g", v);
    return buf;
}

// the range as a rule, worded as gen_params.Bound.rule words it: "must be in (0, 1] (1 = off)", "must be >= 1",
// "must be a finite number >= 0", "must be finite (0 = off)"
static inline std::string clover_gen_param_rule(clover_gen_param_id id) {
    const clover_gen_param_spec & s = clover_gen_param(id);
    const bool has_lo = std::isfinite(s.lo);
    const bool has_hi = std::isfinite(s.hi);
    std::string text;
    if (has_lo && has_hi) {
        text = std::string("must be in ") + (s.lo_open ? "(" : "[") + clover_gen_num_str(s.lo) + ", " +
               clover_gen_num_str(s.hi) + "]";
    } else if (has_lo) {
        text = std::string("must be ") + (s.integer ? "" : "a finite number ") + (s.lo_open ? "> " : ">= ") +
               clover_gen_num_str(s.lo);
    } else if (has_hi) {
        text = "must be a finite number <= " + clover_gen_num_str(s.hi);
    } else {
        text = "must be finite";
    }
    return *s.off ? text + " (" + s.off + ")" : text;
}

// whether the field's C type holds v: an integer field is an int32_t, any other a float (gen_params.Bound.fits)
static inline bool clover_gen_param_fits(clover_gen_param_id id, double v) {
    return clover_gen_param(id).integer ? (v >= INT32_MIN && v <= INT32_MAX) : std::fabs(v) <= FLT_MAX;
}

// what the C type holds, worded as gen_params.Bound.c_rule words it
static inline std::string clover_gen_param_c_rule(clover_gen_param_id id) {
    return clover_gen_param(id).integer ? "must be at most 2147483647 (the engine's 32-bit integer)"
                                        : "must be at most 3.40282e+38 in magnitude (the engine's 32-bit float)";
}

// whether v is in the range (and finite, and whole for an integer field)
static inline bool clover_gen_param_in_range(clover_gen_param_id id, double v) {
    const clover_gen_param_spec & s = clover_gen_param(id);
    if (!std::isfinite(v) || (s.integer && v != std::floor(v))) {
        return false;
    }
    return (s.lo_open ? v > s.lo : v >= s.lo) && v <= s.hi;
}

// whether v is in the range and its C type holds it
static inline bool clover_gen_param_ok(clover_gen_param_id id, double v) {
    return clover_gen_param_in_range(id, v) && clover_gen_param_fits(id, v);
}

// the rule v breaks: the range's, or the C type's when only the type cannot hold it ("" when v is valid)
static inline std::string clover_gen_param_broken(clover_gen_param_id id, double v) {
    if (!clover_gen_param_in_range(id, v)) {
        return clover_gen_param_rule(id);
    }
    return clover_gen_param_fits(id, v) ? "" : clover_gen_param_c_rule(id);
}

// The engine's check of a call's field: empty when v is in range or stands for the GGUF's value, else
// "<field> <rule> (or <unset> for the GGUF's value), got <v>".
static inline std::string clover_gen_param_check(clover_gen_param_id id, double v) {
    if (clover_gen_param_is_unset(id, v) || clover_gen_param_ok(id, v)) {
        return "";
    }
    const clover_gen_param_spec & s = clover_gen_param(id);
    std::string msg = std::string(s.field) + " " + clover_gen_param_broken(id, v);
    if (s.unset != CLOVER_UNSET_NONE) {
        msg += std::string(" (or ") + clover_gen_param_unset_text(id) + " for the GGUF's value)";
    }
    return msg + ", got " + clover_gen_num_str(v);
}
