// Token embedding: out(i, :) = table(tok(i), :). Backward accumulates into the table gradient.
#pragma once

#include "core/kokkos_types.hpp"

namespace mm {

using TokenView = Kokkos::View<const std::int32_t*, Layout, Mem>;

// table (V, D), tokens (n), out (n, D). Token ids must lie in [0, V) (the data loader guarantees it).
template <class T>
void embedding_forward(const View2<const acc_t<T>>& table, const TokenView& tokens, const View2<T>& out);

// dtable (V, D) += sum over i with tokens(i) == v of dout(i, :). Deterministic (ordered per column).
template <class T>
void embedding_backward(const View2<const T>& dout, const TokenView& tokens, const View2<acc_t<T>>& dtable);

}  // namespace mm
