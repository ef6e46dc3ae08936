"""What ``tokenbus up`` prints once the stack is ready."""

from __future__ import annotations

import json

from tokenbus.infra.devstack.stack import EmbeddedStack


def ready_banner(stack: EmbeddedStack) -> str:
    model = stack.settings.models[0]
    base = f"{stack.edge_url}/v1"
    body = json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "Hello!"}]})
    processes = ", ".join(f"{name} ({p.pid})" for name, p in stack.processes.items())
    return f"""
tokenbus is up.

  API       {base}    models: {", ".join(stack.settings.models)}
  API key   {stack.dev_key}   (tenant "dev"; more with `tokenbus keys create`)
  console   {stack.edge_url}/console/   (paste the key: playground, usage, conversations, keys)
  broker    {stack.bootstrap_servers}
  logs      {stack.run_dir}/
  processes {processes}
  processors {stack.processors_url}/metrics   (moderation, transcripts, billing)
  stores    transcripts {stack.transcripts_path}, ClickHouse (chDB) {stack.clickhouse_path}/

Usage and cost per tenant, model and tier:   tokenbus usage --bucket minute [--plot usage.png]
Transcripts of your tenant:                  curl {base}/conversations -H "Authorization: Bearer ..."

Stream a completion:

  curl -N {base}/chat/completions -H "Authorization: Bearer {stack.dev_key}" \\
    -H 'Content-Type: application/json' -d '{body}'

Or with the openai package:

  from openai import OpenAI
  client = OpenAI(base_url="{base}", api_key="{stack.dev_key}")
  for chunk in client.chat.completions.create(model="{model}", stream=True,
          messages=[{{"role": "user", "content": "Hello!"}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None

Ctrl-C (or `tokenbus down`) stops everything.
"""
