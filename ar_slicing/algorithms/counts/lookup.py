"""`BigramCounts`: a complete counts directory read back, with vectorised `lookup(prev, next)`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ar_slicing.algorithms.counts.kernels import kernels
from ar_slicing.algorithms.counts.keys import key_dtype_for
from ar_slicing.algorithms.counts.regions import RegionTable, build_region_table, read_region_table
from ar_slicing.errors import BadInput
from ar_slicing.machinery.layout import BIGRAMS_NAME

_FIB = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: multiplicative (Fibonacci) hashing
_LOOKUP_CHUNK = 1 << 22


def _as_chunks(column) -> list[np.ndarray]:
    """An array, or a list of arrays (chunks), as a list of chunks."""
    return list(column) if isinstance(column, (list, tuple)) else [np.asarray(column)]


class BigramCounts:
    """The counts of a complete counts directory, with vectorised `lookup(prev, next)`.

    With 16-bit ids, counts below 2**32 and the compiled kernels, the table is the per-`prev`
    region table (`region_table`, see `regions`: 16 bytes per distinct bigram, built region by
    region from the sorted rows), which compiled callers may probe themselves. Otherwise it is
    one open-addressing hash table (linear probing, load 0.5): a lookup is one multiply-shift
    and, on average, 1.5 probes; with 16-bit ids each slot packs key and count into one uint64.
    """

    def __init__(
        self, prev: np.ndarray, nxt: np.ndarray, counts: np.ndarray, meta: dict, path=None
    ):
        """`prev`, `nxt`, `counts`: the rows of bigrams.parquet, as arrays or as lists of aligned
        chunks (its row groups, so a large file is never concatenated)."""
        self.path = Path(path) if path is not None else None
        self.meta = meta
        chunks = list(zip(*(_as_chunks(a) for a in (prev, nxt, counts))))
        lows = [min(int(p.min()), int(q.min())) for p, q, _ in chunks if p.size]
        if lows and min(lows) < 0:
            raise BadInput(f"{self._where()}: negative token ids in {BIGRAMS_NAME}")
        top = max((max(int(p.max()), int(q.max())) for p, q, _ in chunks if p.size), default=0)
        max_count = max((int(c.max()) for _, _, c in chunks if c.size), default=0)
        self.shift = 16 if top < 1 << 16 else 32
        self.n_distinct = sum(p.size for p, _, _ in chunks)
        self._total = sum(int(c.sum()) for _, _, c in chunks)
        self.region_table: RegionTable | None = None
        prev, nxt, counts = (
            np.concatenate([c[k] for c in chunks]) if chunks else np.zeros(0, np.int64)
            for k in range(3)
        )
        if self.shift == 16 and max_count < 1 << 32:
            order = np.argsort(prev, kind="stable")  # regions are placed in order of prev
            rows = [(prev[order], nxt[order], counts[order])]
            built = build_region_table(rows, self.n_distinct)
            if built is not None:
                self.region_table = built[0]
                return
        prev, nxt, counts = (a.astype(np.int64, copy=False) for a in (prev, nxt, counts))
        seen = counts > 0  # a stored count of 0 would read as an empty slot mid-probe
        prev, nxt, counts = prev[seen], nxt[seen], counts[seen]
        keys = (prev.astype(np.uint64) << np.uint64(self.shift)) | nxt.astype(np.uint64)
        self._build(keys.astype(key_dtype_for(self.shift)), counts)

    def _where(self) -> str:
        return str(self.path / BIGRAMS_NAME) if self.path else "bigram counts"

    @classmethod
    def open(cls, path: str | Path) -> BigramCounts:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from ar_slicing.machinery.io import read_json
        from ar_slicing.machinery.layout import require_complete

        path = Path(path)
        meta = read_json(require_complete(path, "counts", f"run `arslice count --out {path}`"))
        try:
            with pa.memory_map(str(path / BIGRAMS_NAME)) as source:
                file = pq.ParquetFile(source)
                regions = read_region_table(file)
                if regions is None:
                    table = file.read(columns=["prev", "next", "count"])
        except Exception as e:
            raise BadInput(
                f"counts {path}: cannot read {BIGRAMS_NAME} ({e}); rerun the count stage"
            ) from None
        if regions is not None:
            counts = cls.__new__(cls)
            counts.path, counts.meta, counts.shift = path, meta, 16
            counts.region_table, counts.n_distinct, counts._total = regions
            return counts
        batches = table.to_batches()
        cols = [[b.column(k).to_numpy() for b in batches] for k in range(3)]
        return cls(*cols, meta=meta, path=path)

    @property
    def fingerprint(self) -> str | None:
        return self.meta.get("fingerprint")

    @property
    def total_pairs(self) -> int:
        return int(self.meta.get("total_pairs", self._total))

    def __len__(self) -> int:
        return self.n_distinct

    def _slots(self, keys: np.ndarray, size: int) -> np.ndarray:
        """Home slot of each key: the top 32 bits of a Fibonacci hash, scaled to the table size."""
        h = (keys.astype(np.uint64) * _FIB) >> np.uint64(32)
        return ((h * np.uint64(size)) >> np.uint64(32)).view(np.int64)

    def _build(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Fill the table. Load factor 0.5 (16 bytes per bigram when packed)."""
        n = keys.size
        size = max(16, 2 * n)
        self._size = size  # home slots are scaled to this; the arrays may be longer
        # 16-bit ids and counts below 2**32: key and count share one uint64 slot, so a lookup
        # touches one cache line; otherwise keys and counts are separate arrays.
        self._packed = self.shift == 16 and (n == 0 or int(counts.max()) < 1 << 32)
        value_dtype = np.uint32 if n == 0 or int(counts.max()) < 1 << 32 else np.int64
        compiled = kernels()
        if compiled is not None:  # (16-bit ids with small counts took the region table)
            self._keys = np.zeros(size, dtype=keys.dtype)
            self._values = np.zeros(size, dtype=value_dtype)
            compiled["build_split"](keys, counts.astype(value_dtype), self._keys, self._values)
            return
        # numpy: place keys in order of home slot; each lands on max(its home, the previous
        # key's slot + 1), i.e. with g_i = slot_i - i a running max. No wrap-around is needed:
        # the table gets a tail past the last used slot (probes may still wrap; they stop
        # at an empty slot first).
        home = self._slots(keys, size)
        order = np.argsort(home, kind="stable")
        ramp = np.arange(n, dtype=np.int64)
        slot = np.maximum.accumulate(home[order] - ramp) + ramp if n else ramp
        length = max((int(slot[-1]) if n else 0) + 2, size + 1)
        table_keys = np.zeros(length, dtype=keys.dtype)
        table_values = np.zeros(length, dtype=value_dtype)  # 0 = empty (stored counts are >= 1)
        table_keys[slot] = keys[order]
        table_values[slot] = counts[order]
        if self._packed:
            self._table = (table_keys.astype(np.uint64) << np.uint64(32)) | table_values
        else:
            self._keys, self._values = table_keys, table_values

    def lookup(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        """Training count of each bigram (prev[i], nxt[i]) as int64; 0 for pairs never seen."""
        prev = np.asarray(prev)
        nxt = np.asarray(nxt)
        if prev.shape != nxt.shape:
            raise ValueError(f"lookup: prev {prev.shape} and next {nxt.shape} differ in shape")
        out = np.zeros(prev.shape, dtype=np.int64)
        flat_p, flat_n, flat_out = prev.reshape(-1), nxt.reshape(-1), out.reshape(-1)
        for a in range(0, flat_p.size, _LOOKUP_CHUNK):
            flat_out[a : a + _LOOKUP_CHUNK] = self._lookup_flat(
                flat_p[a : a + _LOOKUP_CHUNK], flat_n[a : a + _LOOKUP_CHUNK]
            )
        return out

    def _lookup_flat(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        compiled = kernels()
        if compiled is not None:
            out = np.empty(prev.size, dtype=np.int64)
            # int64 ids: one compiled signature whatever the caller's dtype
            p = np.ascontiguousarray(prev, dtype=np.int64)
            q = np.ascontiguousarray(nxt, dtype=np.int64)
            if self.region_table is not None:
                self.region_table.probe(p, q, out)
            else:
                compiled["probe_split"](self._keys, self._values, self._size, self.shift, p, q, out)
            return out
        limit = 1 << self.shift
        p64 = prev.astype(np.int64, copy=False)
        n64 = nxt.astype(np.int64, copy=False)
        valid = (p64 >= 0) & (p64 < limit) & (n64 >= 0) & (n64 < limit)
        keys = (np.where(valid, p64, 0).astype(np.uint64) << np.uint64(self.shift)) | np.where(
            valid, n64, 0
        ).astype(np.uint64)
        if self._packed:
            length = self._table.size
        else:
            length = self._keys.size
            keys = keys.astype(self._keys.dtype)
        slot = self._slots(keys, self._size)
        out = np.zeros(prev.size, dtype=np.int64)
        todo = np.arange(prev.size)
        while todo.size:
            if self._packed:
                v = self._table[slot]
                values = (v & np.uint64(0xFFFFFFFF)).view(np.int64)
                hit = (v >> np.uint64(32)) == keys
            else:
                values = self._values[slot].astype(np.int64)
                hit = self._keys[slot] == keys
            out[todo[hit]] = values[hit]
            # keep probing where the slot holds another key; an empty slot (0) ends the probe
            more = ~hit & (values != 0)
            todo, keys, slot = todo[more], keys[more], (slot[more] + 1) % length
        out[~valid] = 0
        return out


# ---- the whole count: plan, map, reduce, write -------------------------------------------------
