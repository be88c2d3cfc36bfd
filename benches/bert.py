"""A BERT-large-shaped encoder trained as a PyTorch user trains it on batches of real
text of different lengths, timed on the batches of the report's BERT rows
(benches/src/bin/bert.rs runs this file with the torch venv's Python and reads its lines).

The model: `transformers`' BertModel of the given shape (random weights, no dropout, the
exact GELU, its default attention: scaled_dot_product_attention) and a linear head
predicting every byte's next byte; a training step is the mean next-byte cross entropy
over the real tokens, backward, SGD at rate 1e-5. Options:
- padded eager: the batch padded to its longest sequence, with an attention mask;
- padded torch.compile;
- padded eager under torch.autocast("cpu", dtype=torch.bfloat16), and under torch.compile;
- torch.nested (jagged layout) eager: the same layers written on nested tensors (BertModel
  does not take them), f32.
`--precision f32` or `bf16` runs that precision's options only (default both).
With the counting malloc preloaded (`nestor_memcount_*` in the process) each option's peak
extra memory is measured over one step.

    python3 benches/bert.py --samples 3 --threads 2 --hidden 1024 --heads 16 \\
        --intermediate 4096 --layers 4 --vocabulary 256 --batch 65,66,67:66,67,68

A batch is its sequences' byte ids, `,` between ids and `:` between sequences. One line
per batch and option:
    <batch index>\\t<option>\\t<median ms>\\t<25th percentile ms>\\t<75th percentile ms>\\t<first call ms>\\t<peak bytes or ->
    <batch index>\\t<option>\\tunavailable\\t<why>
"""
import argparse
import contextlib
import ctypes
import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from timing import print_row, timed  # noqa: E402


def counter():
    """The preloaded counting malloc's (current, peak, reset), or None."""
    try:
        process = ctypes.CDLL(None)
        functions = [
            getattr(process, f"nestor_memcount_{name}") for name in ("current", "peak", "reset")
        ]
    except (AttributeError, OSError):
        return None
    for function in functions[:2]:
        function.restype = ctypes.c_int64
    return functions


def peak_of(step, functions):
    """The most bytes one call of `step` had allocated beyond what was allocated before."""
    if functions is None:
        step()
        return None
    current, peak, reset = functions
    reset()
    before = current()
    step()
    return max(peak() - before, 0)


def jagged_bert(bert, ids, lengths):
    """BertModel's last hidden states computed on a jagged nested batch (f32)."""
    embeddings = bert.embeddings
    positions = torch.cat([torch.arange(length) for length in lengths])
    x = (
        embeddings.word_embeddings(ids)
        + embeddings.position_embeddings(positions)
        + embeddings.token_type_embeddings.weight[0]
    )
    x = embeddings.LayerNorm(x)
    offsets = torch.tensor([0] + list(lengths)).cumsum(0)
    x = torch.nested.nested_tensor_from_jagged(x, offsets)
    heads = bert.config.num_attention_heads
    for layer in bert.encoder.layer:
        attention = layer.attention
        split = lambda t: t.unflatten(-1, (heads, -1)).transpose(1, 2)
        q = split(attention.self.query(x))
        k = split(attention.self.key(x))
        v = split(attention.self.value(x))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)
        x = attention.output.LayerNorm(attention.output.dense(attended) + x)
        hidden = F.gelu(layer.intermediate.dense(x))
        x = layer.output.LayerNorm(layer.output.dense(hidden) + x)
    return x.values()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--intermediate", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--vocabulary", type=int, required=True)
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--batch", action="append", required=True)
    parser.add_argument("--precision", choices=["f32", "bf16", "both"], default="both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=args.vocabulary,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=args.positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    bert = transformers.BertModel(config, add_pooling_layer=False)
    head = torch.nn.Linear(args.hidden, args.vocabulary)
    parameters = list(bert.parameters()) + list(head.parameters())
    optimizer = torch.optim.SGD(parameters, lr=1e-5)
    compiled_bert = torch.compile(bert)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    functions = counter()

    def step_of(loss_of, context=contextlib.nullcontext):
        def step():
            optimizer.zero_grad()
            with context():
                loss = loss_of()
            loss.float().backward()
            optimizer.step()

        return step

    for index, batch in enumerate(args.batch):
        sequences = [[int(byte) for byte in text.split(",")] for text in batch.split(":")]
        lengths = [len(sequence) - 1 for sequence in sequences]
        longest = max(lengths)
        ids = torch.zeros(len(sequences), longest, dtype=torch.long)
        targets = torch.full((len(sequences), longest), -100, dtype=torch.long)
        mask = torch.zeros(len(sequences), longest, dtype=torch.long)
        for at, sequence in enumerate(sequences):
            ids[at, : lengths[at]] = torch.tensor(sequence[:-1])
            targets[at, : lengths[at]] = torch.tensor(sequence[1:])
            mask[at, : lengths[at]] = 1
        packed_ids = torch.cat([torch.tensor(sequence[:-1]) for sequence in sequences])
        packed_targets = torch.cat([torch.tensor(sequence[1:]) for sequence in sequences])

        def padded_loss(model):
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = head(hidden).float()
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

        def jagged_loss():
            hidden = jagged_bert(bert, packed_ids, lengths)
            return F.cross_entropy(head(hidden), packed_targets)

        options = [
            ("padded eager", step_of(lambda: padded_loss(bert))),
            ("padded torch.compile", step_of(lambda: padded_loss(compiled_bert))),
            ("padded eager autocast bf16", step_of(lambda: padded_loss(bert), autocast)),
            ("padded torch.compile autocast bf16", step_of(lambda: padded_loss(compiled_bert), autocast)),
            ("torch.nested jagged eager", step_of(jagged_loss)),
        ]
        wanted = lambda name: args.precision == "both" or ("bf16" in name) == (args.precision == "bf16")
        for name, step in filter(lambda option: wanted(option[0]), options):
            shown = lambda peak: "-" if peak is None else str(peak)
            print_row(
                index,
                name,
                lambda: (*timed(step, args.samples), shown(peak_of(step, functions))),
            )


if __name__ == "__main__":
    main()
