// A library's struct layouts as text, for Python to check its ctypes mirrors against at load: a field
// added, moved or retyped on one side only becomes a clear error instead of memory corruption.
// The text is "Struct=size Struct.field=offset ..." in the order the fields are listed.
#pragma once

#include <cstddef>
#include <string>

namespace ladle_layout {
inline void add(std::string& out, const char* name, std::size_t value) {
  out += name;
  out += '=';
  out += std::to_string(value);
  out += ' ';
}
}  // namespace ladle_layout

// Use inside a lambda that fills a std::string named `out`.
#define LADLE_SIZE(S) ladle_layout::add(out, #S, sizeof(S))
#define LADLE_FIELD(S, f) ladle_layout::add(out, #S "." #f, offsetof(S, f))
