// clover_chat_*: llama-server's chat template machinery (common/chat) for the Python chat client, so that
// `clover-cpp chat` renders a conversation and reads an answer (reasoning, content, tool calls) exactly as
// `clover-cpp serve` does. The request and the results are JSON text, in the shapes llama-server uses.

#include "clover.h"
#include "clover-log.h"

#include "chat.h"
#include "common.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

struct clover_chat_templates {
    common_chat_templates_ptr tmpls;
};

static char * clover_chat_strdup(const std::string & s) {
    char * out = static_cast<char *>(std::malloc(s.size() + 1));
    if (out) {
        std::memcpy(out, s.data(), s.size());
        out[s.size()] = '\0';
    }
    return out;
}

// the request fields of llama-server's chat completions that decide the prompt (oaicompat_chat_params_parse)
static common_chat_templates_inputs clover_chat_inputs(const common_json & body) {
    if (!body.is_object()) {
        throw std::invalid_argument("the request must be a JSON object");
    }
    if (!body.contains("messages") || !body.at("messages").is_array()) {
        throw std::invalid_argument("'messages' must be an array");
    }
    common_chat_templates_inputs inputs;
    inputs.messages = common_chat_msgs_parse_oaicompat(body.at("messages"));
    if (body.contains("tools") && !body.at("tools").is_null()) {
        inputs.tools = common_chat_tools_parse_oaicompat(body.at("tools"));
    }
    if (body.contains("tool_choice")) {
        const common_json & choice = body.at("tool_choice");
        if (!choice.is_string()) {
            throw std::invalid_argument("'tool_choice' must be \"auto\", \"required\" or \"none\"");
        }
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(choice.get<std::string>());
    }
    inputs.parallel_tool_calls   = body.value("parallel_tool_calls", false);
    inputs.add_generation_prompt = body.value("add_generation_prompt", true);
    inputs.enable_thinking       = body.value("enable_thinking", true);
    inputs.reasoning_format      = common_reasoning_format_from_name(body.value("reasoning_format", std::string("auto")));
    if (body.contains("json_schema") && !body.at("json_schema").is_null()) {
        inputs.json_schema = body.at("json_schema").dump();
    }
    if (body.contains("chat_template_kwargs")) {
        const common_json & kwargs = body.at("chat_template_kwargs");
        if (!kwargs.is_object()) {
            throw std::invalid_argument("'chat_template_kwargs' must be an object");
        }
        for (const auto & item : kwargs.items()) {
            inputs.chat_template_kwargs[item.key()] = item.value().dump();
        }
    }
    return inputs;
}

static common_json clover_chat_params_json(const common_chat_params & p) {
    common_json triggers = common_json::array();
    for (const auto & t : p.grammar_triggers) {
        triggers.push_back({{"type", (int) t.type}, {"value", t.value}, {"token", t.token}});
    }
    return {
        {"prompt",             p.prompt},
        {"format",             (int) p.format},
        {"format_name",        common_chat_format_name(p.format)},
        {"generation_prompt",  p.generation_prompt},
        {"grammar",            p.grammar},
        {"grammar_lazy",       p.grammar_lazy},
        {"grammar_triggers",   triggers},
        {"preserved_tokens",   p.preserved_tokens},
        {"additional_stops",   p.additional_stops},
        {"parser",             p.parser},
        {"supports_thinking",  p.supports_thinking},
        {"thinking_start_tag", p.thinking_start_tag},
        {"thinking_end_tags",  p.thinking_end_tags},
    };
}

struct clover_chat_templates * clover_chat_templates_init(const struct llama_model * model, const char * template_override,
                                                          char * err, size_t err_size) {
    try {
        if (!model && (!template_override || !*template_override)) {
            throw std::invalid_argument("no model and no template given");
        }
        auto tmpls = common_chat_templates_init(model, template_override ? template_override : "");
        return new clover_chat_templates{std::move(tmpls)};
    } catch (const std::exception & e) {
        clover_set_err(err, err_size, std::string("chat template: ") + e.what());
    }
    return nullptr;
}

void clover_chat_templates_free(struct clover_chat_templates * tmpls) {
    delete tmpls;
}

char * clover_chat_templates_apply(const struct clover_chat_templates * tmpls, const char * request_json,
                                   char * err, size_t err_size) {
    try {
        if (!tmpls || !request_json) {
            throw std::invalid_argument("no templates or no request given");
        }
        const auto inputs = clover_chat_inputs(common_json::parse(request_json));
        const auto params = common_chat_templates_apply(tmpls->tmpls.get(), inputs);
        return clover_chat_strdup(clover_chat_params_json(params).dump());
    } catch (const std::exception & e) {
        clover_set_err(err, err_size, e.what());
    }
    return nullptr;
}

char * clover_chat_parse(const char * params_json, const char * text, bool is_partial, char * err, size_t err_size) {
    try {
        if (!params_json || !text) {
            throw std::invalid_argument("no parameters or no text given");
        }
        const common_json p = common_json::parse(params_json);
        common_chat_parser_params params;
        params.format            = static_cast<common_chat_format>(p.value("format", 0));
        params.generation_prompt = p.value("generation_prompt", std::string());
        params.reasoning_format  = common_reasoning_format_from_name(p.value("reasoning_format", std::string("auto")));
        params.parse_tool_calls  = p.value("parse_tool_calls", true);
        const std::string parser = p.value("parser", std::string());
        if (!parser.empty()) {
            params.parser.load(parser);
        }
        const common_chat_msg msg = common_chat_parse(text, is_partial, params);
        return clover_chat_strdup(msg.to_json_oaicompat().dump());
    } catch (const std::exception & e) {
        clover_set_err(err, err_size, e.what());
    }
    return nullptr;
}

void clover_chat_string_free(char * s) {
    std::free(s);
}
