"""Runs vLLM's offline engine on a job and prints the results as JSON (one process per engine, as a user runs it).

    python tests/support/run_vllm_engine.py JOB.json

JOB: {"model": folder, "engine": {LLM keyword arguments}, "calls": [[prompt token ids, ...], ...], "max_tokens": n}.
Each call is one `LLM.generate` over its prompts (greedy, the sampled token's log-probability kept); later calls
can hit the prefix cache that earlier ones filled. Prints "RESULT " and
{"calls": [[{"tokens", "logprobs", "cached"}, ...], ...], "preemptions": n or null} on one line (vLLM logs around
it; preemptions are counted where the engine keeps stats, `disable_log_stats=False`).
"""

import json
import sys

MEMORY_SHARE = 0.3


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams

    # On the CPU engine this is the share of the machine's memory vLLM asks for at start-up (it refuses to start when
    # less is free): the tests' engines need little, and other processes may hold the rest.
    llm = LLM(job["model"], **{"gpu_memory_utilization": MEMORY_SHARE, **job["engine"]})
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, logprobs=0, ignore_eos=True)
    calls = []
    for prompts in job["calls"]:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        results = []
        for output in outputs:
            completion = output.outputs[0]
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
            results.append(
                {
                    "tokens": list(completion.token_ids),
                    "logprobs": logprobs,
                    "cached": output.num_cached_tokens or 0,
                }
            )
        calls.append(results)
    # The engine's own count of preempted requests (a Prometheus counter; kept where stats are on)
    preemptions = None
    if job["engine"].get("disable_log_stats") is False:
        preemptions = sum(metric.value for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions")
    print("RESULT " + json.dumps({"calls": calls, "preemptions": preemptions}), flush=True)


if __name__ == "__main__":
    main()
