"""Chat templates in the prompt formats of four model families, for test models made
from the chat starter. Written here from each family's documented format (not copied):
what matters to the tests is where each family puts tools, tool results, thinking and
the assistant's turn, and the syntax its models use to call a tool."""

from __future__ import annotations

# Qwen 3: ChatML turns, tools in the system turn, calls in <tool_call> tags, thinking in
# <think> tags (an empty block when thinking is switched off).
QWEN3 = """{{- if or .System .Tools }}<|im_start|>system
{{ .System }}{{ if .Tools }}
Tools you may call:{{ range .Tools }} {{ .Function.Name }}{{ end }}
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>{{ end }}<|im_end|>
{{ end }}
{{- range .Messages }}
{{- if eq .Role "tool" }}<|im_start|>user
<tool_response>{{ .Content }}</tool_response><|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}{{ range .ToolCalls }}<tool_call>{"name": "{{ .Function.Name }}"}</tool_call>{{ end }}<|im_end|>
{{ else }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}
{{- end }}<|im_start|>assistant
{{ if and .IsThinkSet (not .Think) }}<think>

</think>

{{ end }}"""

# Llama 3.1: header-delimited turns, tools offered in the user turn, a call is a bare
# JSON object {"name", "parameters"}, results come back in the ipython role.
LLAMA31 = """<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>
{{- range .Messages }}
{{- if eq .Role "tool" }}<|start_header_id|>ipython<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- else }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ if and $.Tools (eq .Role "user") }}Call a function as {"name": ..., "parameters": {...}}.
Functions:{{ range $.Tools }} {{ .Function.Name }}{{ end }}

{{ end }}{{ .Content }}<|eot_id|>
{{- end }}
{{- end }}<|start_header_id|>assistant<|end_header_id|>

"""

# Mistral: [INST] turns, tools listed in [AVAILABLE_TOOLS], calls after [TOOL_CALLS] as a
# JSON list, results in [TOOL_RESULTS].
MISTRAL = """{{- if .Tools }}[AVAILABLE_TOOLS]{{ range .Tools }} {{ .Function.Name }}{{ end }}[/AVAILABLE_TOOLS]
{{- end }}
{{- range .Messages }}
{{- if eq .Role "user" }}[INST] {{ if $.System }}{{ $.System }}

{{ end }}{{ .Content }}[/INST]
{{- else if eq .Role "assistant" }}{{ .Content }}{{ if .ToolCalls }}[TOOL_CALLS]{{ end }}</s>
{{- else if eq .Role "tool" }}[TOOL_RESULTS] {{ .Content }}[/TOOL_RESULTS]
{{- end }}
{{- end }}"""

# gpt-oss: harmony messages; the assistant's reply goes to the analysis (thinking),
# commentary (tool calls, addressed to=functions.NAME) and final channels.
GPT_OSS = """<|start|>system<|message|>Reasoning: {{ if .ThinkLevel }}{{ .ThinkLevel }}{{ else }}medium{{ end }}
# Valid channels: analysis, commentary, final.<|end|>
{{- if .Tools }}<|start|>developer<|message|># Tools
{{ range .Tools }}functions.{{ .Function.Name }}
{{ end }}<|end|>{{ end }}
{{- range .Messages }}
{{- if eq .Role "tool" }}<|start|>functions.{{ .ToolName }} to=assistant<|channel|>commentary<|message|>{{ .Content }}<|end|>
{{- else }}<|start|>{{ .Role }}<|message|>{{ .Content }}<|end|>
{{- end }}
{{- end }}<|start|>assistant"""

CITY = '"\\"city\\": \\"" [A-Z] [a-z]{2,6} "\\""'
# What each family's model writes to call get_weather (with a thought first, for Qwen 3).
CALLS = {
    "qwen3": 'root ::= "<think>\\n" [a-z]{3,8} "\\n</think>\\n\\n<tool_call>\\n{\\"name\\": '
             '\\"get_weather\\", \\"arguments\\": {" ' + CITY + ' "}}\\n</tool_call>"',
    "llama3.1": 'root ::= "{\\"name\\": \\"get_weather\\", \\"parameters\\": {" ' + CITY + ' "}}"',
    "mistral": 'root ::= "[TOOL_CALLS][{\\"name\\": \\"get_weather\\", \\"arguments\\": {" '
               + CITY + ' "}}]"',
    "gpt-oss": 'root ::= "<|channel|>analysis<|message|>" [a-z]{3,8} "<|end|><|start|>assistant'
               '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{" '
               + CITY + ' "}<|call|>"',
}
TEMPLATES = {"qwen3": QWEN3, "llama3.1": LLAMA31, "mistral": MISTRAL, "gpt-oss": GPT_OSS}
THINKS = {"qwen3": True, "llama3.1": None, "mistral": None, "gpt-oss": "low"}
