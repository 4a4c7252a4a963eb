// The one header that hides the Catch2 major version (v2 on Debian 12, v3 elsewhere) from the tests.
#pragma once

#if MAMBAMOE_CATCH2_MAJOR >= 3
#include <catch2/catch_approx.hpp>
#include <catch2/catch_session.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
using Catch::Approx;
using Catch::Matchers::ContainsSubstring;
#else
#include <catch2/catch.hpp>
// v3's name for v2's Contains string matcher
inline auto ContainsSubstring(const std::string& s) { return Catch::Matchers::Contains(s); }
#endif
