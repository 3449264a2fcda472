"""What the thread-count search costs: encode of user-made caches with the candidates (1, torch's, CPU count)
against encode with the search off (candidates = [1]), medians of 5, alternated, one process."""
import statistics, time, torch, kvcodec
from kvcodec.tokens import RecordingCache, plan as P
from kvcodec.tokens.plan import cache_kwarg
from transformers import DynamicCache
model, tok = kvcodec.load_model("smollm2", dtype=torch.bfloat16)
text = open(__import__("os").environ.get("KVCODEC_CORPUS", "../shared/corpus") + "/legal_en_gpl-3.0.txt").read()
ids = tok(text[len(text)//2:], return_tensors="pt").input_ids[:, :200]
def make(rec):
    c = (RecordingCache if rec else DynamicCache)(config=model.config)
    with torch.no_grad():
        model.generate(ids, **{cache_kwarg(model): c}, max_new_tokens=41, do_sample=False, pad_token_id=tok.eos_token_id)
    return c
orig = P.step_thread_candidates
for rec in (True, False):
    cache = make(rec)
    t_on, t_off = [], []
    for i in range(5):
        for mode in ("on", "off"):
            P.step_thread_candidates = orig if mode == "on" else (lambda: [1])
            t = time.perf_counter(); kvcodec.encode(cache, (model, tok), token_model="static"); dt = time.perf_counter() - t
            (t_on if mode == "on" else t_off).append(dt)
    P.step_thread_candidates = orig
    print("RecordingCache" if rec else "DynamicCache (inferred)", "candidates", orig(), "search on %.3f s, off %.3f s, ratio %.3f" % (statistics.median(t_on), statistics.median(t_off), statistics.median(t_on)/statistics.median(t_off)))
